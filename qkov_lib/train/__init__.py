"""Training: one run's config and history (:mod:`.config`), the one training loop for one model
or a vmapped stack of models (:mod:`.loop`) and the optimizers with per-group rates
(:mod:`.optim`)."""

from qkov_lib.train.config import OPTIMIZERS, History, NonFiniteError, Probe, TrainConfig, log_schedule, log_steps
from qkov_lib.train.loop import evaluate, loss_fn, predict, train, train_stacked

__all__ = ["OPTIMIZERS", "History", "NonFiniteError", "Probe", "TrainConfig", "evaluate", "log_schedule", "log_steps",
           "loss_fn", "predict", "train", "train_stacked"]
