"""Folders kept in storage, reached by URI (`s3://`, `gs://`, `hdfs://`, `file://`, ...: whatever `pyarrow.fs`
resolves, as Ray Train's `storage_path` does): each node fetches what it needs into its own cache, so nothing
reads a path that another node wrote. No Ray.

A folder is fetched once per node (into `~/.cache/raygent/storage/<hash of the URI>`; `RAYGENT_CACHE` moves it):
downloaded into a temporary folder beside it and renamed, so a reader sees it whole or not at all, and a second
process fetching the same URI at once loses the rename and uses the winner's copy. A URI names an immutable
folder (a checkpoint's `model/`): a changed folder needs a new URI.

S3 settings come from the environment (`AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT_URL`, ...) or from the URI's query,
e.g. `s3://bucket/run/model?endpoint_override=127.0.0.1:9000&scheme=http` for an S3-compatible server.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

_COMPLETE = ".raygent-fetched"  # written last into a fetched folder: a folder without it is not used
STORAGE_COMPLETE = ".complete"  # written last into a folder a run copies to storage: one without it is never used


def is_uri(name: str) -> bool:
    """A storage URI (scheme://...), as opposed to a local path, a hub id or "default"."""
    scheme, sep, _ = name.partition("://")
    return bool(sep) and scheme.isidentifier()


def shown(uri: str) -> str:
    """The URI as messages show it: without credentials (s3://KEY:SECRET@bucket/...)."""
    scheme, _, rest = uri.partition("://")
    netloc, slash, path = rest.partition("/")
    return f"{scheme}://{netloc.rpartition('@')[2]}{slash}{path}"


def cache_root() -> Path:
    return Path(os.environ.get("RAYGENT_CACHE", Path.home() / ".cache" / "raygent")) / "storage"


def _filesystem(uri: str) -> tuple[Any, str]:
    import pyarrow.fs

    try:
        return pyarrow.fs.FileSystem.from_uri(uri)
    except (ValueError, OSError) as e:  # an unknown scheme, a malformed URI, a scheme pyarrow was built without
        raise ValueError(f"{shown(uri)}: not a storage URI pyarrow.fs can open ({e})") from None


def check_folder(uri: str, must_hold: str | None = None) -> None:
    """Raise ValueError (saying why) unless `uri` is a folder in reachable storage (holding `must_hold`)."""
    import pyarrow.fs

    fs, path = _filesystem(uri)
    try:
        info = fs.get_file_info(path)
        inner = fs.get_file_info(f"{path.rstrip('/')}/{must_hold}") if must_hold else None
    except OSError as e:  # unreachable endpoint, refused credentials, missing bucket
        raise ValueError(f"{shown(uri)}: storage not reachable ({str(e).splitlines()[0]})") from None
    if info.type != pyarrow.fs.FileType.Directory:
        raise ValueError(f"{shown(uri)}: no such folder in storage")
    if inner is not None and inner.type != pyarrow.fs.FileType.File:
        raise ValueError(f"{shown(uri)}: the folder holds no {must_hold}")


def local_folder(folder: str) -> str:
    """A folder handed to this process: a storage URI fetched into this node's cache, or a local path as it is (one
    that is not on this node fails here: `check_on_this_node`)."""
    if is_uri(folder):
        return str(fetch_folder(folder))
    check_on_this_node(folder)
    return folder


def looks_local(path: str) -> bool:
    """A path, not a hub id: absolute, or starting with "." or "~"."""
    return path.startswith(("/", ".", "~"))


def check_on_this_node(path: str) -> None:
    """A local-looking path that this node lacks fails here, naming the path, the node and the settings that would
    fix it, instead of reaching transformers, which would take it for a hub id."""
    if looks_local(path) and not Path(path).expanduser().exists():
        import socket

        import ray

        node = f"{socket.gethostname()} ({ray.util.get_node_ip_address()})"
        raise FileNotFoundError(
            f"{path} does not exist on node {node}: a folder on one node's disk is read where it is loaded. A run over "
            "several nodes needs args.checkpoint.storage (a URI every node reaches, e.g. s3://bucket/runs: the "
            "starting model and the checkpoints go through it) or output_dir and the model cache on a disk every "
            "node mounts at the same path (args.checkpoint.shared_disk: true); an agent served on another node "
            "needs policy.model as a storage URI")


def folder_stamp(folder: Path) -> str:
    """What tells two versions of a local folder apart: a hash of its files' names, sizes and mtimes."""
    files = sorted((str(f.relative_to(folder)), f.stat().st_size, f.stat().st_mtime_ns)
                   for f in Path(folder).rglob("*") if f.is_file())
    return hashlib.sha256(repr(files).encode()).hexdigest()[:16]


def fetch_folder(uri: str) -> Path:
    """The folder at `uri`, fetched into this node's cache (once per version: the text of the run's marker in it or
    in its parent, which a new copy of a checkpoint or reference changes): its local path."""
    target = cache_root() / hashlib.sha256((uri + _version(uri)).encode()).hexdigest()[:20]
    if (target / _COMPLETE).is_file():
        return target
    staged = target.with_name(f".{target.name}-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        Storage(uri).download("", staged)
        (staged / _COMPLETE).write_text(shown(uri) + "\n")
        try:
            os.rename(staged, target)
        except OSError:  # another process renamed its (complete) copy first: use that one
            if not (target / _COMPLETE).is_file():
                raise
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return target


def _version(uri: str) -> str:
    base, sep, query = uri.partition("?")
    for folder in (base, base.rstrip("/").rpartition("/")[0]):
        storage = Storage(folder + sep + query)
        if storage.exists(STORAGE_COMPLETE):
            return storage.read_text(STORAGE_COMPLETE)
    return ""


class Storage:
    """A folder in storage (a URI or a local path) and what a run does under it, by paths relative to it."""

    def __init__(self, uri: str):
        import pyarrow.fs

        self.uri = uri
        if is_uri(uri):
            self.fs, self.base = _filesystem(uri)
        else:
            self.fs, self.base = pyarrow.fs.LocalFileSystem(), str(Path(uri).expanduser().resolve())

    def __repr__(self) -> str:
        return f"Storage({shown(self.uri)!r})"

    def uri_of(self, rel: str) -> str:
        """The URI of `rel` under this folder (its query, such as an endpoint override, kept)."""
        base, sep, query = self.uri.partition("?")
        return f"{base.rstrip('/')}/{rel}{sep}{query}"

    def _path(self, rel: str = "") -> str:
        return f"{self.base.rstrip('/')}/{rel}".rstrip("/") if rel else self.base

    def check_writable(self) -> None:
        """Raise ValueError (saying why) unless a file can be written and removed here."""
        probe = self._path(f".raygent-probe-{os.getpid()}")
        try:
            self.fs.create_dir(self.base, recursive=True)
            with self.fs.open_output_stream(probe) as f:
                f.write(b"ok")
            self.fs.delete_file(probe)
        except OSError as e:
            raise ValueError(f"{shown(self.uri)}: storage not writable ({str(e).splitlines()[0]})") from None

    def exists(self, rel: str) -> bool:
        import pyarrow.fs

        return self.fs.get_file_info(self._path(rel)).type != pyarrow.fs.FileType.NotFound

    def folders(self, rel: str = "") -> list[str]:
        """The names of the folders directly under `rel` (none if it does not exist)."""
        import pyarrow.fs

        selector = pyarrow.fs.FileSelector(self._path(rel), allow_not_found=True)
        return sorted(i.base_name for i in self.fs.get_file_info(selector) if i.type == pyarrow.fs.FileType.Directory)

    def write_text(self, rel: str, text: str) -> None:
        with self.fs.open_output_stream(self._path(rel)) as f:
            f.write(text.encode())

    def read_text(self, rel: str) -> str:
        with self.fs.open_input_stream(self._path(rel)) as f:
            return f.read().decode()

    def upload(self, local: str | Path, rel: str) -> None:
        """A local file or folder (recursively) to `rel`."""
        import pyarrow.fs

        local = Path(local).resolve()
        if local.is_dir():
            self.fs.create_dir(self._path(rel), recursive=True)
        pyarrow.fs.copy_files(str(local), self._path(rel), source_filesystem=pyarrow.fs.LocalFileSystem(),
                              destination_filesystem=self.fs, use_threads=True)

    def download_into(self, rel: str, local_dir: str | Path) -> None:
        """The files of folder `rel` into a local folder (beside what it holds; made if missing)."""
        import pyarrow.fs

        Path(local_dir).mkdir(parents=True, exist_ok=True)

        pyarrow.fs.copy_files(self._path(rel), str(local_dir), source_filesystem=self.fs,
                              destination_filesystem=pyarrow.fs.LocalFileSystem(), use_threads=True)

    def download(self, rel: str, local: str | Path) -> None:
        """`rel` (a file, or a folder recursively) to a local path that must not exist yet: written beside it
        and renamed, so it appears whole."""
        import pyarrow.fs

        local = Path(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{local.name}-", dir=local.parent))
        try:
            is_dir = self.fs.get_file_info(self._path(rel)).type == pyarrow.fs.FileType.Directory
            inner = tmp if is_dir else tmp / local.name
            pyarrow.fs.copy_files(self._path(rel), str(inner), source_filesystem=self.fs,
                                  destination_filesystem=pyarrow.fs.LocalFileSystem(), use_threads=True)
            os.rename(tmp if is_dir else inner, local)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def delete(self, rel: str) -> None:
        """A folder and everything under it (nothing if it does not exist)."""
        if self.exists(rel):
            self.fs.delete_dir(self._path(rel))
