"""Which `transformers.Trainer` methods the engine defines, inherits or replaces: the method contract, as
`hf_compat` is the fields' one.

Every method of the installed `transformers.Trainer` is in exactly one of these (a test keeps it so):
- *ours*: defined on `shardtrain.Trainer` with Hugging Face's signature and called where Hugging Face calls it
  (read from the class, not listed here);
- `HONOURED`: not defined here, but an override (a subclass's, a library's) is called where the engine does
  that job;
- `INHERITED`: Hugging Face's own code runs, on the engine's attributes, whoever calls it;
- `REPLACED`: the engine does the job another way and never calls the method. Calling it stays possible, but
  a subclass that overrides one is refused when the class is built, with the method's name and the fix
  (`replaced_overrides`), unless that override was read and found to do what the engine already does
  (`AUDITED`). So an override is never skipped in silence.
"""

from __future__ import annotations

import inspect
from typing import Any

import transformers
from transformers.utils import can_return_loss, find_labels

from shardtrain.model_facts import base_model

HONOURED: dict[str, str] = {
    "_save": "save_model calls it on rank 0 with self.model a whole CPU copy (from the gathered weights), as "
             "Hugging Face calls it on the main process; else the engine writes the files from every rank",
    "get_resumed_dataloader": "a resume inside an epoch calls it on an overridden get_train_dataloader's loader, with "
                              "the micro-batches the finished steps used, and reads the epoch's batches from what it "
                              "returns (Hugging Face's default skips them); the engine's own batch plan resumes at "
                              "the step without it (a warning says so)",
}

INHERITED: dict[str, str] = {
    "_get_learning_rate": "the scheduler's last learning rate",
    "_get_output_dir": "the run directory (output_dir, or run-<trial> under hyperparameter_search)",
    "_hp_search_setup": "a trial's hyperparameters into the arguments, at train()",
    "_load_callback_state": "stateful callbacks restored on resume (restore_callback_states_from_checkpoint)",
    "add_callback": "transformers' CallbackHandler",
    "pop_callback": "transformers' CallbackHandler",
    "remove_callback": "transformers' CallbackHandler",
    "call_model_init": "builds the model from model_init, at __init__ and at every train()",
    "end": "finishes the trackers and destroys the process group",
    "get_decay_parameter_names": "create_optimizer's weight-decay grouping",
    "get_learning_rates": "the optimizer's groups",
    "get_optimizer_group": "the optimizer's groups",
    "get_num_trainable_parameters": "counts the model's parameters",
    "get_total_train_batch_size": "per-device batch x accumulation x ranks",
    "init_hf_repo": "creates the Hub repository on the job's main process (push_to_hub), at __init__",
    "push_to_hub": "save_model on every rank, then the job's main process uploads output_dir",
    "_push_from_checkpoint": "after each committed checkpoint (push_to_hub): the main process uploads the model "
                             "files it holds, and the checkpoint under hub_strategy checkpoint / all_checkpoints",
    "_finish_current_push": "waits for the uploads in flight, at the end of train()",
    "hyperparameter_search": "Hugging Face's (optuna), each trial a train() on the engine",
    "num_examples": "len() of a loader's dataset",
    "store_flos": "adds current_flos (the engine counts total_flos per step itself)",
    "autocast_smart_context_manager": "a library's own steps call it; the engine's steps run under FSDP2's mixed "
                                      "precision",
    "compute_loss_context_manager": "a library's own steps call it; the engine's steps run under FSDP2's mixed "
                                    "precision",
}

REPLACED: dict[str, str] = {
    "_inner_training_loop": "the engine's loop (train); override training_step or compute_loss",
    "_run_epoch": "the engine's loop (train); override training_step or compute_loss",
    "_prepare_for_training": "the engine's loop (train); override training_step or compute_loss",
    "_finalize_training": "the engine's loop (train); add a TrainerCallback's on_train_end",
    "_init_training_state": "the engine's loop (train); add a TrainerCallback's on_train_begin",
    "set_initial_training_values": "the engine's batch plan; set max_steps or num_train_epochs",
    "get_batch_samples": "the engine's batch plan (exact global token counts); override _get_train_sampler",
    "_prepare_input": "the engine moves batches to the device in _prepare_inputs (override that)",
    "_get_num_items_in_batch": "the engine counts the global batch's target tokens itself",
    "_maybe_log_save_evaluate": "the engine's log/evaluate/save step (DefaultFlowCallback's flags); override log, "
                                "or add a TrainerCallback",
    "_determine_best_metric": "the engine's best-metric rule (metric_for_best_model, greater_is_better)",
    "_clip_grad_norm": "the engine clips the global gradient norm (max_grad_norm)",
    "_get_grad_norm": "the engine clips the global gradient norm (max_grad_norm)",
    "_has_mixed_mesh_grads": "the engine clips the global gradient norm over every mesh",
    "_mixed_mesh_grad_norm": "the engine clips the global gradient norm over every mesh",
    "_defer_fsdp_gradient_reduction": "FSDP2 reduces gradients once per optimizer step",
    "_sync_replicated_trainable_parameters": "FSDP2 keeps replicated parameters in step",
    "_track_num_input_tokens": "the engine counts num_input_tokens_seen per step",
    "floating_point_ops": "the engine estimates total_flos per step as transformers: 6 x the whole model's "
                          "non-embedding parameters (a pipeline's too) x input tokens (real ones: transformers "
                          "counts padding)",
    "_wrap_model": "the engine shards the model (ModelPreparation); configure it with fsdp_config",
    "_move_model_to_device": "fully_shard places each unit on the device",
    "_prepare_context_parallel_inputs": "the engine splits sequences over cp ranks (cp_size)",
    "_build_accelerator_args": "no Accelerator runs the job; Trainer.accelerator is built on the engine",
    "_validate_args": "the engine's argument checks, at TrainingArguments()",
    "_get_dataloader": "the engine's loaders; override get_train_dataloader / get_eval_dataloader",
    "_get_collator_with_removed_columns": "the engine's collators (remove_unused_columns); override "
                                          "_set_signature_columns_if_needed",
    "_remove_unused_columns": "the engine's collators (remove_unused_columns); override "
                              "_set_signature_columns_if_needed",
    "_load_from_checkpoint": "the checkpoint manager loads the model (and the rest) on resume; override "
                             "_load_optimizer_and_scheduler to load state of your own after it",
    "_load_best_model": "the checkpoint manager loads the best checkpoint (load_best_model_at_end)",
    "_issue_warnings_after_load": "the checkpoint manager checks every key and shape before loading",
    "_load_rng_state": "the checkpoint manager restores every rank's RNG",
    "_load_scaler": "no gradient scaler (FSDP2 mixed precision)",
    "_save_optimizer_and_scheduler": "the checkpoint manager writes them; override _save_checkpoint and call "
                                     "super() to add files of your own",
    "_save_rng_state": "the checkpoint manager writes every rank's RNG",
    "_save_scaler": "no gradient scaler (FSDP2 mixed precision)",
    "_tune_save_checkpoint": "Ray Tune is not a hyperparameter_search backend here (optuna is)",
    "_update_auto_batch_size": "the engine's auto_find_batch_size",
}

# Library overrides of REPLACED methods, read and found to do only what the engine already does:
# "module.Class.method" -> what it does
AUDITED: dict[str, str] = {
    "sentence_transformers.base.trainer.BaseTrainer._load_from_checkpoint":
        "loads the checkpoint's weights into the model, which the checkpoint manager does on resume",
    "sentence_transformers.base.trainer.BaseTrainer._load_best_model":
        "loads the best checkpoint's weights (the checkpoint manager does) and records its step on the model card",
}


def owner(cls: type, name: str) -> type | None:
    """The class of `cls`'s MRO whose own namespace defines `name` (None when none does)."""
    return next((klass for klass in cls.__mro__ if name in vars(klass)), None)


def replaced_overrides(cls: type, engine: type) -> list[tuple[str, str]]:
    """(method, defining class) for each REPLACED method that `cls` or a base of it overrides, other than
    transformers' and the `engine` Trainer's own definitions and the AUDITED overrides."""
    found = []
    for name in REPLACED:
        klass = owner(cls, name)
        if klass is None or klass in (transformers.Trainer, engine):
            continue
        where = f"{klass.__module__}.{klass.__qualname__}"
        if f"{where}.{name}" not in AUDITED:
            found.append((name, where))
    return found


def hf_methods() -> set[str]:
    """The methods (functions, static and class methods, properties) of the installed `transformers.Trainer`."""
    return {name for name, value in vars(transformers.Trainer).items()
            if not (name.startswith("__") and name.endswith("__"))
            and (inspect.isfunction(value) or isinstance(value, staticmethod | classmethod | property))}


def methods_rows(ours: set[str]) -> list[tuple[str, str, str]]:
    """(method, status, note) for every method of transformers' Trainer; `ours`: the names our Trainer defines."""
    rows = []
    for name in sorted(hf_methods()):
        if name in ours:
            rows.append((name, "ours", "Hugging Face's signature, called where Hugging Face calls it"))
        elif name in HONOURED:
            rows.append((name, "override honoured", HONOURED[name]))
        elif name in INHERITED:
            rows.append((name, "inherited", INHERITED[name]))
        else:
            rows.append((name, "replaced (override refused)", REPLACED.get(name, "not classified")))
    return rows


def methods_table(ours: set[str]) -> str:
    """The rows as a Markdown table (headed by the transformers version it was generated from)."""
    lines = [f"Methods of transformers {transformers.__version__}'s `Trainer`:", "", "| method | status | note |",
             "|---|---|---|"]
    lines += [f"| `{name}` | {status} | {note} |" for name, status, note in methods_rows(ours)]
    return "\n".join(lines) + "\n"


def label_names(model: Any, args: Any) -> list[str]:
    """Hugging Face's rule: the arguments' `label_names`, else the forward's parameters named like a label (none
    for a sentence-transformers model, whose trainer then evaluates through its `compute_loss`)."""
    return find_labels(type(base_model(model))) if args.label_names is None else list(args.label_names)


def set_hf_attributes(trainer: Any) -> None:
    """The attributes of a `transformers.Trainer` that its public methods, callbacks and subclasses read."""
    args = trainer.args
    trainer.is_in_train = False
    trainer.hp_name = trainer.hp_search_backend = trainer.deepspeed = trainer.label_smoother = None
    trainer._trial = None  # the hyperparameter_search trial train() runs (Hugging Face's _hp_search_setup sets it)
    trainer.place_model_on_device = trainer.is_deepspeed_enabled = trainer.is_fsdp_xla_enabled = False
    trainer.is_fsdp_xla_v1_enabled = trainer.is_fsdp_xla_v2_enabled = False
    trainer.is_distributed_loading_by_transformers = False
    trainer.hub_model_id = None  # Hugging Face sets it in init_hf_repo (push_to_hub); TRL's model card reads it
    trainer.push_in_progress = None  # the uploads in flight (Hugging Face's _push_from_checkpoint)
    trainer.is_model_parallel = False
    # Hugging Face's flag means "Accelerate's FSDP plugin shards the model": never here (args.fsdp_enabled says
    # whether shardtrain's FSDP2 does), so libraries do not hand their extra models to Accelerate's FSDP
    trainer.is_fsdp_enabled = False
    trainer.label_names = label_names(trainer.model, args)
    trainer.can_return_loss = can_return_loss(type(base_model(trainer.model)))
    trainer.neftune_noise_alpha = args.neftune_noise_alpha
    trainer.current_flos = 0
    trainer._train_batch_size = args.train_batch_size
    trainer._created_lr_scheduler = False
    trainer.model_accepts_loss_kwargs = False  # the token sum is computed here, not by the model
