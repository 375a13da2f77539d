"""common.optim: torch.optim's SGD and Adam, bit for bit, without importing torch._dynamo."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from common import optim
from conftest import ROOT

CASES = [
    (optim.SGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4}),
    (optim.SGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (optim.SGD, torch.optim.SGD, {"lr": 0.05}),
    (optim.Adam, torch.optim.Adam, {"lr": 1e-2, "fused": True}),
    (optim.Adam, torch.optim.Adam, {"lr": 1e-2, "weight_decay": 1e-3}),
]


def train(optimizer_class, kwargs, model, steps=4):
    torch.manual_seed(1)
    opt = optimizer_class(model.parameters(), **kwargs)
    for _ in range(steps):
        x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return opt


@pytest.mark.parametrize("ours,theirs,kwargs", CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_same_updates_and_state_as_torch(ours, theirs, kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    start = copy.deepcopy(model.state_dict())
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    opt_a, opt_b = train(ours, kwargs, a), train(theirs, kwargs, b)
    assert not torch.equal(a[0].weight, start["0.weight"])  # it trained
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    state_a, state_b = opt_a.state_dict(), opt_b.state_dict()
    assert state_a["param_groups"] == state_b["param_groups"]
    for k in state_b["state"]:
        for name, value in state_b["state"][k].items():
            assert torch.equal(torch.as_tensor(state_a["state"][k][name]), torch.as_tensor(value))
    # torch's state loads into ours and the next step agrees again (a copy: loading keeps
    # tensors that need no conversion, and both would then update one momentum buffer)
    opt_a.load_state_dict(copy.deepcopy(state_b))
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    for model_, opt in ((a, opt_a), (b, opt_b)):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model_(x), y).backward()
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_optimizers_step_without_importing_dynamo():
    code = """
import sys, torch
from common.optim import SGD, Adam
model = torch.nn.Linear(3, 2)
for opt in (SGD(model.parameters(), lr=0.1, momentum=0.9), Adam(model.parameters(), fused=True)):
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
print("ours", "torch._dynamo" in sys.modules)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
print("torch", "torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    # the control line shows the premise: torch.optim's own class imports it
    assert out.split() == ["ours", "False", "torch", "True"]
