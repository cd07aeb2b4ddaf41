"""The full training objective, ignore_index / padding, activation checkpointing, the frozen Engram compressor,
the three-tier optimizer groups and a short `transformers.Trainer` fine-tune that lowers the loss; `spike-whale
finetune`'s argument checks, its stop at a non-finite loss, its save-time destination check and its logged rate."""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from spike_whale.hub_export.finetune import three_tier_param_groups, unsupported

# Every loss term on: learned-router MoE layers (plus a hash layer), HRM deep supervision over 3 steps,
# the abstain head, two MTP heads and the z-loss, on top of the tiny model's 114M mechanisms.
FULL = dict(
    use_moe=True, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, num_hash_layers=1,
    moe_intermediate_size=48, moe_aux_loss_coef=0.05, hrm_refine_steps=3, use_abstain_head=True,
    num_nextn_predict_layers=2, use_elo=True, use_value_embed=True, engram_fusion_layers=[2], engram_fusion_dim=16,
)

TEXT = (
    "The whale surfaced twice near the breakwater, then dove again. Gulls circled the harbour while the "
    "fishing boats came home. The whale surfaced twice near the breakwater, then dove again. A child on the "
    "pier counted the spouts: one, two, three. The whale surfaced twice near the breakwater, then dove again. "
    "By evening the water was calm and the lighthouse turned its slow beam over the bay."
)


def byte_ids(text: str) -> list[int]:
    return [b + 4 for b in text.encode("utf-8")]  # the tokenizer's single-byte ids


def test_full_objective_reports_every_term_and_sums_them():
    model = tiny_model(**FULL).train()
    cfg = model.config
    ids = torch.randint(4, 16000, (2, 24), generator=torch.Generator().manual_seed(0))
    out = model(ids, labels=ids)
    terms = dict(lm=out.lm_loss, z=out.z_loss, mtp=out.mtp_loss, hrm=out.hrm_loss, abstain=out.abstain_loss,
                 aux=out.moe_aux_loss)
    for name, term in terms.items():
        assert term is not None and term.dim() == 0 and torch.isfinite(term), name
    expected = (out.lm_loss + cfg.zloss_coef * out.z_loss + cfg.mtp_loss_weight * out.mtp_loss + out.hrm_loss
                + cfg.abstain_loss_weight * out.abstain_loss + cfg.moe_aux_loss_coef * out.moe_aux_loss)
    torch.testing.assert_close(out.loss, expected)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_ignore_index_and_padding_are_respected_by_every_term():
    model = tiny_model(**FULL).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 16000, (2, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding of row 1
    labels = ids.clone()
    labels[0, :4] = -100
    fields = ("loss", "lm_loss", "z_loss", "mtp_loss", "hrm_loss", "abstain_loss", "moe_aux_loss")
    with torch.no_grad():
        a = model(ids, attention_mask=mask, labels=labels)
        # What sits under the padding (ids and labels) must not matter to any term.
        other = ids.clone()
        other[1, :6] = torch.randint(4, 16000, (6,), generator=g)
        b = model(other, attention_mask=mask, labels=labels)
        for name in fields:
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=1e-5, msg=name)
        # Masking by attention_mask equals writing -100 by hand.
        manual = labels.clone()
        manual[1, :6] = -100
        c = model(ids, attention_mask=mask, labels=manual)
        for name in fields:
            torch.testing.assert_close(getattr(a, name), getattr(c, name), msg=name)
        # lm_loss is the CE over exactly the counted targets: real target, real source position (the first real
        # token of row 1 is not predicted from the pad before it).
        target = manual[:, 1:]
        keep = (target != -100) & (mask[:, :-1] == 1)
        assert keep.sum() == (19 - 3) + (19 - 6)
        ref = F.cross_entropy(a.logits[:, :-1][keep], target[keep])
        torch.testing.assert_close(a.lm_loss, ref)
        # A batch with nothing to predict gives zeros, not NaN.
        none = model(ids, attention_mask=mask, labels=torch.full_like(ids, -100))
        for name in ("lm_loss", "z_loss", "mtp_loss", "hrm_loss", "abstain_loss"):
            assert getattr(none, name) == 0, name
        assert torch.isfinite(none.loss)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients_and_keeps_the_compressor_frozen(reentrant):
    ids = torch.randint(4, 16000, (2, 20), generator=torch.Generator().manual_seed(2))

    def grads(checkpointing: bool):
        model = tiny_model(**FULL).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            assert all(layer.gradient_checkpointing for layer in model.model.layers)
        model(ids, labels=ids).loss.backward()
        compressor = model.model.engram.compressor.proj.weight
        assert not compressor.requires_grad and compressor.grad is None
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    ref, got = grads(False), grads(True)
    assert set(ref) == set(got)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_three_tier_param_groups():
    model = tiny_model(**FULL)
    groups = three_tier_param_groups(model, lr=1e-3, embedding_lr_scale=0.1, weight_decay=0.05)
    by_name = {g["name"]: g for g in groups}
    assert set(by_name) == {"embedding", "matrix", "scalar"}
    assert by_name["embedding"]["lr"] == pytest.approx(1e-4) and by_name["embedding"]["weight_decay"] == 0.0
    assert by_name["matrix"]["lr"] == 1e-3 and by_name["matrix"]["weight_decay"] == 0.05
    assert by_name["scalar"]["weight_decay"] == 0.0
    ids = {id(p) for g in groups for p in g["params"]}
    assert sum(len(g["params"]) for g in groups) == len(ids)  # no parameter twice (tied lm_head)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert ids == trainable
    assert id(model.model.engram.compressor.proj.weight) not in ids
    emb = {id(p) for p in by_name["embedding"]["params"]}
    assert id(model.model.embed_tokens.weight) in emb and id(model.lm_head.weight) in emb
    assert all(id(t.weight) in emb for t in model.model.engram.lookup.tables)
    assert id(model.model.loop_pass_embed.weight) in emb
    assert all(p.dim() >= 2 for p in by_name["matrix"]["params"])
    assert all(p.dim() <= 1 for p in by_name["scalar"]["params"])
    assert three_tier_param_groups(model, 1e-3)[0]["lr"] == pytest.approx(1e-4)


def test_trainer_fine_tune_lowers_the_loss(tmp_path):
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = tiny_model(**FULL).train()
    compressor = model.model.engram.compressor.proj.weight.detach().clone()
    tokens = byte_ids(TEXT)  # ~420 tokens
    block = 48
    rows = [tokens[i : i + block] for i in range(0, len(tokens) - block + 1, 24)]
    data = [{"input_ids": torch.tensor(r), "labels": torch.tensor(r)} for r in rows]

    def eval_loss():
        model.eval()
        with torch.no_grad():
            batch = torch.stack([d["input_ids"] for d in data])
            out = model(batch, labels=batch)
        model.train()
        return out.lm_loss.item(), out.loss.item()

    before_lm, before_total = eval_loss()
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_train_epochs=4, learning_rate=3e-3,
        logging_steps=5, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
        gradient_accumulation_steps=1, lr_scheduler_type="constant",
    )
    optimizer = torch.optim.AdamW(three_tier_param_groups(model, lr=3e-3))
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, None))
    result = trainer.train()
    after_lm, after_total = eval_loss()
    assert result.global_step >= 12
    assert after_lm < before_lm - 1.0 and after_total < before_total - 1.0
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert logged[-1] < logged[0]
    assert torch.equal(model.model.engram.compressor.proj.weight, compressor)  # frozen stays frozen
    assert not model.model.engram.compressor.proj.weight.requires_grad


def test_knob_parameters_survive_save_and_load(tmp_path):
    """`_init_weights` (transformers.initialization) must not overwrite loaded knob parameters."""
    from spike_whale import SpikeWhaleForCausalLM

    model = tiny_model(**dict(FULL, use_derf=True))  # Elo wins; DERF is not built
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in ("elo_k", "abstain_head.bias", "ffn.gate.weight")):
                p.add_(0.25)
    model.save_pretrained(tmp_path)
    again = SpikeWhaleForCausalLM.from_pretrained(tmp_path).eval()
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    ids = torch.randint(4, 16000, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        # Same values, not bitwise: loaded weights may sit in another memory layout, which changes MKL's summation order.
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


# `spike-whale finetune` on a tiny folder: arguments, divergence, the destination at save time, the logged rate.
FINETUNE = ["--steps", "3", "--batch-size", "2", "--seq-len", "16"]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from _tiny_folder import write_tiny_folder

    return write_tiny_folder(tmp_path_factory.mktemp("finetune") / "tiny")


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return str(path)


def load_tiny(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)


def tiny_rows(folder):
    from transformers import AutoTokenizer

    from spike_whale.hub_export import finetune

    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    rows = finetune.token_rows(tokenizer, TEXT, 16)
    return rows, finetune.global_batches(rows.shape[0], 4, 2, 0)


def nan_from_call(model, n: int):
    """Make the model's loss NaN from its n-th forward on (as a diverging run's would become)."""
    forward, calls = model.forward, []

    @functools.wraps(forward)  # the Trainer keeps only the dataset columns forward's signature names
    def poisoned(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append(1)
        if len(calls) >= n:
            out.loss = out.loss * float("nan")
        return out

    model.forward = poisoned
    return model


@pytest.mark.parametrize("flag", ["--lr=inf", "--lr=-inf", "--lr=nan", "--lr=0", "--lr=-1e-4", "--max-grad-norm=-1",
                                  "--max-grad-norm=0", "--max-grad-norm=inf", "--max-grad-norm=nan"])
def test_finetune_refuses_non_finite_or_non_positive_rates(flag, tiny_folder, text_file, tmp_path, capsys):
    from spike_whale.hub_export import cli

    out = tmp_path / "out"
    assert cli.main(["finetune", tiny_folder, str(out), "--text", text_file, *FINETUNE, flag]) == 1
    err = capsys.readouterr().err.strip()
    assert flag.split("=")[0] in err and "finite number above 0" in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_finetune_names_a_missing_model_folder(text_file, tmp_path, capsys):
    from spike_whale.hub_export import cli

    assert cli.main(["finetune", str(tmp_path / "nope"), str(tmp_path / "out"), "--text", text_file]) == 1
    err = capsys.readouterr().err.strip()
    assert "nope: no such folder" in err and "huggingface" not in err and len(err.splitlines()) == 1, err


def test_diverging_train_loop_keeps_the_last_good_weights(tiny_folder):
    """The loss turns NaN at the third step: the loop stops and the model holds the last weights that gave a finite
    loss (those after one step; the second step's were never checked), the very weights one step gives."""
    from spike_whale.hub_export import finetune

    rows, batches = tiny_rows(tiny_folder)
    reference, _ = finetune.train_loop(load_tiny(tiny_folder), rows, batches[:1], lr=1e-3)
    with pytest.raises(finetune.Diverged, match="step 3 of 4: the loss") as caught:
        finetune.train_loop(nan_from_call(load_tiny(tiny_folder), 3), rows, batches, lr=1e-3)
    model, losses = caught.value.result
    assert caught.value.steps == 1 and len(losses) == 2 and all(math.isfinite(x) for x in losses)
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(got, want), name


@pytest.mark.skipif(unsupported(trainer=True, fsdp_size=1) is not None, reason=str(unsupported(True, 1)))
def test_diverging_trainer_keeps_the_last_good_weights_and_logs_the_base_rate(tiny_folder, tmp_path):
    """Through `transformers.Trainer`: the same stop and kept weights, and the logged learning rate is `--lr`
    (the main group's), not the embeddings' 0.1x."""
    from spike_whale.hub_export import finetune

    rows, batches = tiny_rows(tiny_folder)

    def arguments(steps):
        return finetune.trainer_arguments(str(tmp_path), global_batch=2, steps=steps, lr=1e-4, max_grad_norm=1.0)

    reference, _ = finetune.train_with_trainer(load_tiny(tiny_folder), rows, batches[:1], arguments(1), lr=1e-4)
    rates = [entry["learning_rate"] for entry in reference.state.log_history if "learning_rate" in entry]
    assert rates and all(rate == 1e-4 for rate in rates), rates
    with pytest.raises(finetune.Diverged, match="step 3 of 4") as caught:
        finetune.train_with_trainer(nan_from_call(load_tiny(tiny_folder), 3), rows, batches, arguments(4), lr=1e-4)
    trainer, _ = caught.value.result
    assert caught.value.steps == 1
    for (name, got), want in zip(trainer.model.named_parameters(), reference.model.parameters()):
        assert torch.equal(got, want), name


@pytest.mark.parametrize("trainer", [False, pytest.param(True, marks=pytest.mark.skipif(
    unsupported(trainer=True, fsdp_size=1) is not None, reason=str(unsupported(True, 1))))])
def test_finetune_that_diverges_fails_and_writes_no_nan_weights(trainer, tiny_folder, text_file, tmp_path, capsys):
    """A finite but absurd --lr makes the first update overflow: the command fails in one line and writes nothing
    (no step gave good weights), instead of saving NaN weights with exit 0."""
    from spike_whale.hub_export import cli

    out = tmp_path / "out"
    args = ["finetune", tiny_folder, str(out), "--text", text_file, *FINETUNE, "--lr", "1e30"]
    assert cli.main([*args, *(["--trainer"] if trainer else [])]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "training diverged at step 2 of 3" in err[-1] and "nothing was written" in err[-1], err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("overwrite", [False, True])
def test_finetune_rechecks_out_dir_at_save_time(overwrite, tiny_folder, text_file, tmp_path, monkeypatch, capsys):
    """OUT_DIR made, holding a user's file, while the model trains: the save refuses it (with --overwrite too: the
    file is not an export's), the user's file stays, and the trained model is kept next to it, as the error says."""
    from spike_whale.hub_export import cli, finetune

    out = tmp_path / "ftout2"
    train_loop = finetune.train_loop

    def train_then_user_writes(*args, **kwargs):
        result = train_loop(*args, **kwargs)
        out.mkdir()
        (out / "NOTES.txt").write_text("n")
        return result

    monkeypatch.setattr(finetune, "train_loop", train_then_user_writes)
    flags = ["--overwrite"] if overwrite else []
    assert cli.main(["finetune", tiny_folder, str(out), "--text", text_file, *FINETUNE, *flags]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert sorted(p.name for p in out.iterdir()) == ["NOTES.txt"] and (out / "NOTES.txt").read_text() == "n"
    kept = tmp_path / f"ftout2.kept-{os.getpid()}"
    assert f"saved to {kept} instead" in err and "changed while the command ran" in err, err
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in kept.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
