"""Optimizers, learning-rate schedules and gradient clipping, identical on every rank.

:class:`SGD`, :class:`Adam` and :class:`AdamW` follow ``torch.optim``'s
formulas, defaults and state; :mod:`~disttensor_nn.optim.lr_scheduler` holds
torch's schedulers; :func:`clip_grad_norm_` clips by the norm of the whole
distributed model's gradient. Their state is laid out as the parameters are
(sharded with sharded parameters), and their state dictionaries are whole,
so they load under any split. :func:`shard_state` shards their state (and
optionally the gradients) over the ranks that replicate each parameter.
"""

from __future__ import annotations

from . import lr_scheduler
from .adam import Adam, AdamW
from .clip import clip_grad_norm_
from .optimizer import STAGES, Optimizer
from .sgd import SGD
from .shard import BUILT_STAGES, check_stage, shard_state

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "clip_grad_norm_", "lr_scheduler",
           "shard_state", "check_stage", "STAGES", "BUILT_STAGES"]
