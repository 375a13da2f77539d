"""PyTorch's SGD and Adam, without the ``torch._dynamo`` import that their first call costs.

PyTorch wraps ``Optimizer.add_param_group``, ``zero_grad``, ``state_dict``,
``load_state_dict`` and every optimiser's ``step`` in guards that keep ``torch.compile`` from
tracing them. The guards import ``torch._dynamo`` on first use (recognised upstream as slow,
pytorch/pytorch#162595): here about 3 s of CPU and 150 MiB per process, more than
``import torch`` itself. Nothing in this project is compiled, so the guards buy nothing, while a
deployed ClientApp is a fresh process per message (Flower's design) and paid the import on every
training message.

The classes here are the ``torch.optim`` classes with those methods replaced by the very
functions the guards wrap (:func:`inspect.unwrap`): the same update, state, hooks and errors,
bit-identical results (``tests/test_optim.py``). They must not be used inside a
``torch.compile``-d region.
"""

from __future__ import annotations

import inspect

import torch
from torch.optim import Optimizer


def _eager(optimizer_class: type[Optimizer]) -> type[Optimizer]:
    """A subclass of ``optimizer_class`` whose guarded methods run unguarded (see the module)."""
    step = inspect.unwrap(optimizer_class.step)

    def unguarded_step(self, closure=None):
        # what the step guard does besides the import: grad mode off unless differentiable
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return step(self, closure)

    namespace = {
        name: inspect.unwrap(getattr(Optimizer, name))
        for name in ("add_param_group", "zero_grad", "state_dict", "load_state_dict")
    }
    namespace.update(
        step=unguarded_step,
        __doc__=f"``torch.optim.{optimizer_class.__name__}`` without the torch._dynamo import "
        f"(module :mod:`common.optim`); same arguments.",
        __module__=__name__,
    )
    return type(optimizer_class.__name__, (optimizer_class,), namespace)


SGD = _eager(torch.optim.SGD)
Adam = _eager(torch.optim.Adam)
