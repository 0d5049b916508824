"""LoRA without Ray (actors/lora.py and the Train job's model, actors/trainer.py): two FSDP2 ranks train the adapter
alone, pack it alone under peft's names, and a resume from their sharded state continues exactly; the merged
weights and the adapter folder (loaded by peft itself) give the policy; the adapter switched off gives the base
model, the KL reference of a LoRA run."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from actors.config import LoraConfig
from actors.lora import AdapterOff, adapter_items, add_adapter, merge, read_adapter, write_adapter
from tests.update_helpers import LORA, build_model, free_port, load_model, lora_steps_on_ranks, make_rows

N_ROWS = 13


@pytest.mark.slow  # two process groups of two ranks
def test_two_fsdp_ranks_train_only_the_adapter_send_it_alone_and_resume_exactly(tmp_path):
    folder = build_model(tmp_path / "base", seed=0)
    rows = make_rows(N_ROWS, seed=5)
    state = tmp_path / "train_state"
    mp.start_processes(lora_steps_on_ranks, args=(2, free_port(), str(folder), rows,
                                                  [list(range(7)), list(range(7, N_ROWS))], str(state), None,
                                                  str(tmp_path / "a.pt")), nprocs=2, start_method="spawn")
    run = torch.load(tmp_path / "a.pt")

    # Only the adapter trains: every other parameter is still the base model's after two steps.
    assert run["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in run["trainable"])
    base = load_model(folder).state_dict()
    frozen = {n: p for n, p in run["params"].items() if n not in run["trainable"]}
    for name, value in frozen.items():
        assert torch.equal(value, base[name.removeprefix("base_model.model.").replace(".base_layer", "")]), name

    # The replicas get the adapter alone, under the names of peft's saved format, and training moved B off zero.
    assert run["kind"] == "adapter"
    assert set(run["adapter"]) == {n.replace(".default", "") for n in run["trainable"]}
    assert max(float(t.abs().max()) for n, t in run["adapter"].items() if ".lora_B." in n) > 0
    adapter_bytes = sum(t.numel() for t in run["adapter"].values()) * 4
    assert adapter_bytes < 0.2 * sum(t.numel() for t in base.values()) * 4

    # Resumed in one unsharded process from the sharded state: the same adapter, then the same next step (up to
    # the order of the gradient sums over two ranks vs one, far below one Adam step of lr 1e-2).
    lora_steps_on_ranks(0, 1, None, str(folder), rows, [list(range(N_ROWS))], None, str(state),
                        str(tmp_path / "b.pt"))
    resumed = torch.load(tmp_path / "b.pt")
    for name, tensor in run["adapter"].items():
        assert torch.equal(resumed["adapter"][name], tensor), name
    assert max(float((resumed["params"][n] - run["params"][n]).abs().max()) for n in run["trainable"]) < 1e-5


def test_merged_weights_and_adapter_folder_give_the_policy_and_adapter_off_the_base(tmp_path):
    folder = build_model(tmp_path / "base", seed=1)
    spec = LoraConfig(**LORA)
    model = add_adapter(load_model(folder), spec)
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:  # a fresh adapter is the identity (B = 0): make it change the policy
                p.normal_(0.0, 0.3)
    adapter = dict(adapter_items(model.state_dict().items()))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        policy = model(input_ids=ids).logits
        base = load_model(folder)(input_ids=ids).logits
        off = AdapterOff(model)(input_ids=ids).logits
    assert (policy - base).abs().max() > 1e-2, "the adapter changes nothing: the checks below could not fail"
    assert torch.allclose(off, base, atol=1e-6)

    plain = load_model(folder)
    plain.load_state_dict(merge(plain.state_dict(), adapter, spec.scale))
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, policy, atol=1e-5)

    from peft import PeftModel

    write_adapter(tmp_path / "adapter", adapter, spec, str(folder))
    tensors, config = read_adapter(tmp_path / "adapter")
    assert config["r"] == spec.rank and config["lora_alpha"] == spec.alpha and set(tensors) == set(adapter)
    loaded = PeftModel.from_pretrained(load_model(folder), str(tmp_path / "adapter"))
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, policy, atol=1e-6)
