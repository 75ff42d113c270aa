"""torch.optim optimizers as the shards' spec (ps_worker.torch_optim): classes, groups matched by
parameter identity, pairs, defaults against group overrides, tables' row optimizer, refusals."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from ps_common.optimizer import OPTIMIZERS, OptimizerSpec
from ps_worker.optim_wrap import keep_groups, shared_groups, spec_of
from ps_worker.torch_optim import CLASSES, translate


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.ln = nn.LayerNorm(3)
        self.head = nn.Linear(3, 2)


class Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(50, 4, mode="sum", sparse=True)
        self.fc = nn.Linear(4, 1)


def named(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters())


def spec(model: nn.Module, opt) -> dict:
    return translate(opt, named(model)).spec


def test_sgd_defaults_become_the_spec() -> None:
    m = Net()
    s = spec(m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4))
    assert s == {"name": "sgd", "lr": 0.05, "momentum": 0.9, "dampening": 0.0, "weight_decay": 1e-4, "nesterov": 1.0}
    assert "groups" not in s


def test_adamw_decay_groups_by_identity_and_betas() -> None:
    m = Net()
    params = {n: p for n, p in m.named_parameters()}
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=torch.tensor(6e-4),
        betas=(0.9, 0.95),
        fused=False,
    )
    s = spec(m, opt)
    assert s["name"] == "adamw" and s["beta1"] == 0.9 and s["beta2"] == 0.95
    assert math.isclose(s["lr"], 6e-4, rel_tol=1e-6) and isinstance(s["lr"], float)
    assert s["weight_decay"] == 0.1
    assert s["groups"] == [{"params": ["fc.bias", "ln.weight", "ln.bias", "head.bias"], "weight_decay": 0.0}]
    assert not {"fused", "foreach", "capturable", "differentiable", "decoupled_weight_decay"} & set(s)
    built = OptimizerSpec(
        s["name"],
        {k: v for k, v in s.items() if k not in ("name", "groups")},
        tuple((tuple(g["params"]), {k: v for k, v in g.items() if k != "params"}) for g in s["groups"]),
    )
    assert built.group_of(["fc.weight", "fc.bias"]) == [0, 1]


def test_group_overrides_only_what_differs_and_flags() -> None:
    m = Net()
    opt = torch.optim.Adam(
        [
            {"params": m.fc.parameters()},
            {"params": m.ln.parameters(), "lr": 0.5, "amsgrad": True},
            {"params": m.head.parameters()},
        ],
        lr=0.01,
    )
    s = spec(m, opt)
    assert "amsgrad" not in s
    assert s["groups"] == [
        {"params": ["ln.weight", "ln.bias"], "amsgrad": 1.0, "lr": 0.5},
        {"params": ["head.weight", "head.bias"]},
    ]


def test_tied_weights_count_once() -> None:
    m = Net()
    m.head.weight = nn.Parameter(torch.zeros(2, 3))
    m.extra = nn.Linear(3, 2)
    m.extra.weight = m.head.weight  # tied: named_parameters() lists it once
    s = spec(m, torch.optim.SGD(m.parameters(), lr=0.1))
    assert s["name"] == "sgd"


@pytest.mark.parametrize("cls", [c for c, n in CLASSES.items() if n in OPTIMIZERS], ids=lambda c: c.__name__)
def test_every_class_on_the_shards_today_builds(cls) -> None:
    m = Net()
    s = spec(m, cls(m.parameters(), lr=0.01))
    kwargs = {k: v for k, v in s.items() if k not in ("name", "groups")}
    OptimizerSpec(s["name"], kwargs).build(m.parameters())


@pytest.mark.skipif("adadelta" not in OPTIMIZERS, reason="adadelta is not on the shards in this build")
def test_adadelta_translates_to_a_spec_the_shards_take() -> None:
    m = Net()
    s = spec(m, torch.optim.Adadelta(m.parameters(), lr=1.0, rho=0.95))
    assert s == {"name": "adadelta", "lr": 1.0, "rho": 0.95, "eps": 1e-6, "weight_decay": 0.0}
    OptimizerSpec(s["name"], {k: v for k, v in s.items() if k != "name"}).build(m.parameters())


def test_rprop_pairs() -> None:
    m = Net()
    s = spec(m, torch.optim.Rprop(m.parameters(), lr=0.01, etas=(0.4, 1.3), step_sizes=(1e-5, 10)))
    assert (s["eta_minus"], s["eta_plus"], s["step_size_min"], s["step_size_max"]) == (0.4, 1.3, 1e-5, 10.0)


def test_lbfgs_is_refused_naming_what_runs() -> None:
    m = Net()
    with pytest.raises(ValueError, match=r"LBFGS does not run on the shards \(it needs a closure") as exc:
        spec(m, torch.optim.LBFGS(m.parameters()))
    for name in ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop"):
        assert name in str(exc.value)


def test_unknown_class_and_subclass_refused() -> None:
    class MySGD(torch.optim.SGD):
        pass

    m = Net()
    with pytest.raises(ValueError, match="MySGD does not run on the shards"):
        spec(m, MySGD(m.parameters(), lr=0.1))


def test_a_parameter_in_no_optimizer_is_refused_unless_frozen() -> None:
    m = Net()
    with pytest.raises(ValueError, match=r"Parameter 'head.weight' is in no optimizer: every trained parameter"):
        spec(m, torch.optim.SGD(list(m.fc.parameters()) + list(m.ln.parameters()) + [m.head.bias], lr=0.1))
    m.head.weight.requires_grad_(False)
    t = translate(torch.optim.AdamW(p for p in m.parameters() if p.requires_grad), named(m))
    assert t.spec["groups"] == [{"params": ["head.weight"], "lr": 0.0, "weight_decay": 0.0}]
    assert t.hyperparameters({"lr", "weight_decay"})[-1] == {"lr": 0.0, "weight_decay": 0.0}


def test_two_optimizers_over_one_parameter_refused() -> None:
    m = Net()
    with pytest.raises(ValueError, match="'fc.weight' is in SGD #0 group 0 and in SGD #1 group 0"):
        spec(m, [torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m.fc.parameters(), lr=0.1)])


def test_two_dense_classes_refused_and_same_class_merged() -> None:
    m = Net()
    with pytest.raises(ValueError, match="dense parameters are under adam and sgd"):
        spec(
            m,
            [torch.optim.SGD(m.fc.parameters(), lr=0.1), torch.optim.Adam([*m.ln.parameters(), *m.head.parameters()])],
        )
    s = spec(
        m,
        [
            torch.optim.SGD(m.fc.parameters(), lr=0.1),
            torch.optim.SGD([*m.ln.parameters(), *m.head.parameters()], lr=0.2),
        ],
    )
    assert s["lr"] == 0.1 and s["groups"] == [
        {"params": ["ln.weight", "ln.bias", "head.weight", "head.bias"], "lr": 0.2}
    ]


def test_an_argument_without_equivalent_is_refused() -> None:
    m = Net()
    with pytest.raises(ValueError, match="decoupled_weight_decay=True"):
        spec(m, torch.optim.Adam(m.parameters(), decoupled_weight_decay=True))


def test_not_an_optimizer() -> None:
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        spec_of(Net(), object())
    assert spec_of(Net(), {"name": "sgd", "lr": 0.1}) == (None, {"name": "sgd", "lr": 0.1})


def test_sparse_adam_over_table_weights_is_the_row_optimizer() -> None:
    m = Sparse()
    dense = torch.optim.Adam(m.fc.parameters(), lr=1e-3)
    sparse = torch.optim.SparseAdam(m.emb.parameters(), lr=0.05, betas=(0.8, 0.99))
    t, s = spec_of(m, [dense, sparse])
    assert s["name"] == "adam" and "groups" not in s
    assert s["sparse"] == {"name": "adam", "lr": 0.05, "beta1": 0.8, "beta2": 0.99, "eps": 1e-8}
    sparse.param_groups[0]["lr"] = 0.01  # a scheduler's change reaches the row pushes
    assert t.row_hyperparameters() == {"lr": 0.01, "beta1": 0.8, "beta2": 0.99, "eps": 1e-8}
    groups, defaults = shared_groups([dense, sparse])
    assert groups[1] is sparse.param_groups[0] and defaults["lr"] == 1e-3


def test_tables_under_adam_or_dense_under_sparse_adam_refused() -> None:
    m = Sparse()
    with pytest.raises(
        ValueError, match="Table 'emb.weight' is under torch.optim.Adam, which takes no sparse gradients"
    ):
        spec_of(m, torch.optim.Adam(m.parameters()))
    with pytest.raises(ValueError, match="SparseAdam takes sparse embedding tables only, but it holds 'fc.weight'"):
        spec_of(m, torch.optim.SparseAdam(m.parameters()))
    with pytest.raises(ValueError, match="'emb.weight' \\(a sparse embedding table\\) is in no optimizer"):
        spec_of(m, torch.optim.Adam(m.fc.parameters()))


def test_one_sgd_over_dense_and_tables() -> None:
    m = Sparse()
    _, s = spec_of(m, torch.optim.SGD(m.parameters(), lr=0.1))
    assert s["sparse"] == {"name": "sgd", "lr": 0.1, "momentum": 0.0, "weight_decay": 0.0}
    with pytest.raises(ValueError, match="nesterov"):
        spec_of(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True))


def test_keep_groups_keeps_the_group_dicts_across_load_state_dict() -> None:
    """torch's load_state_dict puts new group dicts in place; keep_groups writes their values back
    into the dicts in use (which pushes and DistributedOptimizer share), keys the saved group lacks
    going as in torch."""
    m = Net()
    opt = torch.optim.AdamW([{"params": [m.fc.weight]}, {"params": [m.fc.bias], "weight_decay": 0.0}], lr=0.1)
    saved = copy.deepcopy(opt.state_dict())
    groups, dicts = opt.param_groups, list(opt.param_groups)
    keep_groups(opt)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)  # adds initial_lr, which the saved groups lack
    saved["param_groups"][0]["lr"] = 0.02
    opt.load_state_dict(saved)
    assert opt.param_groups is groups and all(a is b for a, b in zip(opt.param_groups, dicts, strict=True))
    assert opt.param_groups[0]["lr"] == 0.02 and "initial_lr" not in opt.param_groups[0]
    assert opt.param_groups[0]["params"] == [m.fc.weight] and opt.param_groups[1]["weight_decay"] == 0.0
