"""fastpersist.metabuffers.recreate_meta_buffers: the meta buffers no checkpoint holds get
the values the model computes for them (its ``_init_weights``, or the module rebuilt from
its config), never by overwriting a real tensor, and the names it cannot compute are
returned."""

from __future__ import annotations

import torch
from torch import nn

from fastpersist.metabuffers import recreate_meta_buffers


def _inv_freq(dim: int) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


class Rotary(nn.Module):
    """Parameter-free, built from a config (the shape of transformers 4.x rotary modules)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", _inv_freq(config["dim"]), persistent=False)


class WithInit(nn.Module):
    """A model whose ``_init_weights`` computes the rotary buffer (transformers 5's way)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.rot = Rotary({"dim": 8})
        self.calls: list[str] = []

    def _init_weights(self, module: nn.Module) -> None:
        self.calls.append(type(module).__name__)
        if isinstance(module, Rotary):
            module.inv_freq.copy_(_inv_freq(module.config["dim"]) * 2)  # *2: proves this way ran
        if isinstance(module, nn.Linear):
            module.weight.fill_(7.0)


def test_initialiser_computes_the_buffer() -> None:
    with torch.device("meta"):
        m = WithInit()
    assert recreate_meta_buffers(m, lambda n: False) == []
    assert m.rot.inv_freq.device.type == "cpu" and torch.equal(m.rot.inv_freq, _inv_freq(8) * 2)
    assert m.calls == ["Rotary"]  # only the modules that own a missing buffer
    assert m.proj.weight.device.type == "meta"  # parameters are the checkpoint's business


def test_rebuild_from_config_without_initialiser() -> None:
    with torch.device("meta"):
        outer = nn.Sequential(nn.Linear(4, 4), Rotary({"dim": 6}))
    assert recreate_meta_buffers(outer, lambda n: False) == []
    assert torch.equal(outer[1].inv_freq, _inv_freq(6))


def test_buffers_in_the_checkpoint_are_left_alone() -> None:
    with torch.device("meta"):
        m = WithInit()
    assert recreate_meta_buffers(m, lambda n: n == "rot.inv_freq") == []
    assert m.rot.inv_freq.device.type == "meta" and m.calls == []


def test_initialiser_never_runs_on_a_module_holding_real_tensors() -> None:
    """A module with a real parameter and a meta buffer: its initialiser would overwrite the
    parameter, so it is not called; the buffer is reported."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))
            self.register_buffer("table", torch.empty(3, device="meta"), persistent=False)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mixed = Mixed()

        def _init_weights(self, module: nn.Module) -> None:
            for t in list(module._parameters.values()) + list(module._buffers.values()):
                t.data.fill_(5.0)

    m = Model()
    assert recreate_meta_buffers(m, lambda n: False) == ["mixed.table"]
    assert torch.equal(m.mixed.weight, torch.ones(3)) and m.mixed.table.device.type == "meta"


def test_an_initialiser_that_writes_only_part_is_not_taken() -> None:
    class Half(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b", torch.zeros(4), persistent=False)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.h = Half()

        def _init_weights(self, module: nn.Module) -> None:
            if isinstance(module, Half):
                module.b[:2] = 1.0

    with torch.device("meta"):
        m = Model()
    assert recreate_meta_buffers(m, lambda n: False) == ["h.b"]
    assert m.h.b.device.type == "meta"


def test_shared_buffer_gets_one_value_in_every_place() -> None:
    with torch.device("meta"):
        rot = Rotary({"dim": 4})
        m = nn.ModuleDict({"a": rot, "b": rot})
    assert recreate_meta_buffers(m, lambda n: False) == []
    assert m["a"].inv_freq is m["b"].inv_freq and torch.equal(m["a"].inv_freq, _inv_freq(4))
