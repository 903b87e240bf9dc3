"""The parts of a `transformers.Trainer` that Hugging Face's own code and the libraries built on it (TRL,
sentence-transformers) read: its attributes, `accelerator`, `callbacks`, the signature-columns hook, the parallel
sizes, and the loss conventions (`_loss_scale`, `_loss_per_sample`). Part of `Trainer`."""

from __future__ import annotations

from typing import Any

from shardtrain.parallel.accelerate_bridge import engine_accelerator
from shardtrain.train.data import forward_columns
from shardtrain.train.hp_search import report_agreed
from shardtrain.train.state import TrainerCallback


class HFInternalsMixin:
    """Hugging Face's internals that subclasses and libraries use, on shardtrain's engine."""

    def _set_hf_attributes(self) -> None:
        """The attributes of a `transformers.Trainer` that its public methods, callbacks and subclasses read."""
        args = self.args
        self.model_wrapped = self.model  # the model as it runs (FSDP2 shards the module in place)
        self.is_in_train = False
        self.hp_name = self.hp_search_backend = self.deepspeed = self.label_smoother = None
        self._trial = None  # the hyperparameter_search trial train() runs (Hugging Face's _hp_search_setup sets it)
        self.place_model_on_device = self.is_deepspeed_enabled = self.is_fsdp_xla_enabled = False
        self.is_model_parallel = False
        # Hugging Face's flag means "Accelerate's FSDP plugin shards the model": never here (args.fsdp_enabled says
        # whether shardtrain's FSDP2 does), so libraries do not hand their extra models to Accelerate's FSDP
        self.is_fsdp_enabled = False
        self.label_names = list(args.label_names) if args.label_names else ["labels"]
        self.can_return_loss = False
        self.neftune_noise_alpha = args.neftune_noise_alpha
        self.current_flos = 0
        self._train_batch_size = args.train_batch_size
        self._created_lr_scheduler = False
        self.model_accepts_loss_kwargs = False  # the token sum is computed here, not by the model

    @property
    def callbacks(self) -> list[TrainerCallback]:
        return self.callback_handler.callbacks

    @property
    def accelerator(self) -> Any:
        """An Accelerate `Accelerator` on shardtrain's process group, for the code of libraries built on Hugging
        Face's Trainer (`gather_for_metrics`, `num_processes`, `unwrap_model`, `is_main_process`). It never wraps,
        shards or moves the model: shardtrain's backend does that. Built on first use."""
        if self.__dict__.get("_accelerator") is None:
            self.__dict__["_accelerator"] = engine_accelerator(self.backend, self.args)
        return self.__dict__["_accelerator"]

    @accelerator.setter
    def accelerator(self, value: Any) -> None:
        self.__dict__["_accelerator"] = value

    def create_accelerator_and_postprocess(self) -> None:
        """Hugging Face's hook after a trial's arguments are set: the engine's `accelerator` is rebuilt on next
        use (from the new arguments); no Accelerate plugin is ever created."""
        self.__dict__["_accelerator"] = None

    def _report_to_hp_search(self, trial: Any, step: int, metrics: dict[str, float]) -> None:
        """Hugging Face's: a trial's intermediate objective to its study (which may prune it); on several ranks,
        rank 0's decision is every rank's (`shardtrain.train.hp_search`)."""
        def report() -> None:
            super(HFInternalsMixin, self)._report_to_hp_search(trial, step, metrics)

        if self.world_size == 1 or trial is None or self.hp_search_backend != "optuna":
            return report()
        report_agreed(report, rank=self.rank, broadcast=lambda t: self.backend.broadcast(t, src=0),
                      device=self.device, on_pruned=lambda: self._fire("on_train_end"))

    def _set_signature_columns_if_needed(self) -> None:
        """Hugging Face's hook: the dataset columns `remove_unused_columns` keeps (the model's forward
        parameters and the label names)."""
        if self._signature_columns is None:
            self._signature_columns = sorted(forward_columns(self.model))

    def get_tp_size(self) -> int:
        return self.dims.tp

    def get_cp_size(self) -> int:
        return self.dims.cp

    def get_sp_size(self) -> int:
        return 1

    @property
    def _loss_scale(self) -> int:
        """Hugging Face's factor on a loss normalised by the global `num_items_in_batch`: the ranks with distinct
        data (DDP averages gradients over them; tensor-parallel ranks share theirs). `compute_loss` returns it
        multiplied in, and `training_step` divides it out, so a library's `compute_loss` that applies it (TRL's)
        trains exactly."""
        return self.world_size // self.dims.tp if self.args.average_tokens_across_devices else 1

    @property
    def _loss_per_sample(self) -> bool:
        """Whether `compute_loss` returns a mean over its micro-batch (Hugging Face's `loss_is_scaled_for_ga`
        False, e.g. TRL's DPO): such a loss is weighted by the micro-batch's samples; otherwise it is the sum
        over target tokens divided by `num_items_in_batch`."""
        return self.loss_is_scaled_for_ga is False
