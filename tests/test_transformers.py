"""transformers end to end: a tiny model built from a config (no downloads) saved
through fastpersist and loaded by transformers, and a ``Trainer`` that saves and
resumes with the torch.save switch on.

Runs under transformers 4.57 (the last 4.x, whose ``load_state_dict`` refuses a
safetensors file whose ``__metadata__`` exists without a known ``format``) and 5.x
(which dropped that check): :func:`_transformers4_accepts` is 4.57's rule, checked on
every file whatever version is installed, and under 4.57 ``from_pretrained`` and
``load_state_dict`` apply it themselves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

import fastpersist  # noqa: E402

#: transformers 4.57 modeling_utils.load_state_dict: metadata None, or a "format" among these.
_TRANSFORMERS4_FORMATS = ("pt", "tf", "flax", "mlx")


def _transformers4_accepts(path: Path) -> bool:
    """transformers 4.57's check of a ``.safetensors`` file before loading it."""
    with safetensors.safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    return metadata is None or metadata.get("format") in _TRANSFORMERS4_FORMATS


def _config() -> Any:
    """A Llama of a few KB: 2 layers, hidden size 16, untied embeddings, no dropout."""
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
    )


def _model(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_config()).eval()


def _assert_same_state(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def _check_loads(directory: Path, model: Any, weights: str) -> None:
    """from_pretrained(directory) and transformers' load_state_dict(weights) give model's tensors."""
    from transformers.modeling_utils import load_state_dict

    assert _transformers4_accepts(directory / weights) if weights.endswith(".safetensors") else True
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(directory))
    _assert_same_state(loaded.state_dict(), model.state_dict())
    _assert_same_state(load_state_dict(str(directory / weights)), model.state_dict())


def test_fastpersist_save_loads_with_from_pretrained(tmp_path: Path) -> None:
    """fastpersist.save of a .safetensors path writes {"format": "pt"} (transformers 4.x's rule)."""
    model = _model()
    model.config.save_pretrained(str(tmp_path))
    fastpersist.save(model.state_dict(), tmp_path / "model.safetensors")
    with safetensors.safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert fastpersist.verify(tmp_path / "model.safetensors").status == "ok"  # CRCs kept, elsewhere
    _check_loads(tmp_path, model, "model.safetensors")


def test_save_file_stand_in_loads_with_from_pretrained(tmp_path: Path) -> None:
    """fastpersist.save_file with no metadata writes none (as safetensors' save_file): accepted;
    with save_pretrained's own metadata: accepted; with other metadata: refused by 4.x as stock's is."""
    model = _model()
    model.config.save_pretrained(str(tmp_path))
    path = tmp_path / "model.safetensors"
    fastpersist.save_file(model.state_dict(), path)
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert f.metadata() is None
    _check_loads(tmp_path, model, "model.safetensors")
    fastpersist.save_file(model.state_dict(), path, metadata={"format": "pt"})
    _check_loads(tmp_path, model, "model.safetensors")

    # metadata without a format: 4.x refuses fastpersist's file exactly as it refuses stock's
    stock = tmp_path / "stock.safetensors"
    safetensors.torch.save_file(model.state_dict(), str(stock), metadata={"k": "v"})
    fastpersist.save_file(model.state_dict(), path, metadata={"k": "v"})
    assert _transformers4_accepts(path) is _transformers4_accepts(stock) is False


def test_switch_pytorch_model_bin_loads_with_from_pretrained(tmp_path: Path) -> None:
    """With patch_torch_save, save_pretrained(safe_serialization=False) (4.x) or torch.save of
    the state dict writes pytorch_model.bin through fastpersist; transformers loads it."""
    model = _model()
    model.config.save_pretrained(str(tmp_path))
    with fastpersist.patch_torch_save():
        torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
        _check_loads(tmp_path, model, "pytorch_model.bin")
    with zipfile.ZipFile(tmp_path / "pytorch_model.bin") as z:  # fastpersist's aligned storages
        names = [n for n in z.namelist() if n.endswith("/.storage_alignment")]
        assert len(names) == 1 and int(z.read(names[0])) >= 4096


def test_accelerate_adapter_model_safetensors_loads_with_from_pretrained(fresh_accelerate: Any,
                                                                         tmp_path: Path) -> None:
    """The Accelerate adapter's save_state writes model.safetensors with {"format": "pt"}, as
    stock Accelerate does; transformers 4.x and 5.x load it."""
    from accelerate import Accelerator

    model = _model()
    acc = Accelerator(cpu=True)
    prepared = acc.prepare(model)
    fresh_accelerate.enable(acc)
    out = tmp_path / "ckpt"
    acc.save_state(str(out))
    weights = out / "model.safetensors"
    with safetensors.safe_open(str(weights), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert fastpersist.verify(weights).status == "ok"  # written by fastpersist, CRCs checked
    acc.unwrap_model(prepared).config.save_pretrained(str(out))
    _check_loads(out, model, "model.safetensors")


_TRAIN = textwrap.dedent(
    """
    import json, sys
    import torch
    import transformers

    out, max_steps, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3] or None
    print(json.dumps({"patched": hasattr(torch.save, "_fastpersist_original")}), flush=True)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            ids = torch.arange(i, i + 8) % 64
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=max_steps, save_steps=3, per_device_train_batch_size=2, learning_rate=1e-2,
        use_cpu=True, report_to=[], logging_steps=100, seed=1, data_seed=2, dataloader_num_workers=0,
        lr_scheduler_type="linear", warmup_steps=1, disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=resume)
    """
)


def _train(script: Path, out: Path, max_steps: int, resume: str = "") -> None:
    env = dict(os.environ, FASTPERSIST_PATCH_TORCH_SAVE="1", CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONHASHSEED="0")
    proc = subprocess.run([sys.executable, str(script), str(out), str(max_steps), resume], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert json.loads(proc.stdout.splitlines()[0]) == {"patched": True}


def _torch_files_by_fastpersist(directory: Path) -> list[str]:
    names = []
    for path in sorted(directory.iterdir()):
        if path.suffix in (".pt", ".pth", ".bin"):
            with zipfile.ZipFile(path) as z:
                align = [n for n in z.namelist() if n.endswith("/.storage_alignment")]
                assert len(align) == 1 and int(z.read(align[0])) >= 4096, path.name
            assert fastpersist.verify(path).status == "ok", path.name
            names.append(path.name)
    return names


def _checkpoint_state(directory: Path) -> dict:
    """Everything of a Trainer checkpoint that a resume restores, as comparable values."""
    state: dict = {f"model.{k}": v for k, v in safetensors.torch.load_file(str(directory / "model.safetensors")).items()}
    optim = torch.load(directory / "optimizer.pt", weights_only=True)
    for pid, s in optim["state"].items():
        for k, v in s.items():
            state[f"optimizer.{pid}.{k}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
    sched = torch.load(directory / "scheduler.pt", weights_only=True)
    state["scheduler.last_epoch"] = torch.tensor(sched["last_epoch"])
    state["scheduler.lr"] = torch.tensor(sched["_last_lr"])
    trainer_state = json.loads((directory / "trainer_state.json").read_text())
    state["global_step"] = torch.tensor(trainer_state["global_step"])
    return state


def test_trainer_resumes_from_checkpoint_written_through_the_switch(tmp_path: Path) -> None:
    """A Trainer with FASTPERSIST_PATCH_TORCH_SAVE=1 (a fresh process, the start-up hook)
    saves checkpoints whose optimizer/scheduler/RNG/args files fastpersist wrote; a second
    process resumes from step 3 and reaches the very state of the uninterrupted run at step 6."""
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _train(script, straight, 6)
    written = _torch_files_by_fastpersist(straight / "checkpoint-3")
    assert {"optimizer.pt", "scheduler.pt", "training_args.bin"} <= set(written)
    assert any(n.startswith("rng_state") for n in written)

    _train(script, resumed, 6, resume=str(straight / "checkpoint-3"))
    assert not (resumed / "checkpoint-3").exists()  # it started from step 3
    expected, got = _checkpoint_state(straight / "checkpoint-6"), _checkpoint_state(resumed / "checkpoint-6")
    assert sorted(expected) == sorted(got)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
