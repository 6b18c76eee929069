"""speculators 0.9.0's own training path, as `speculators train --vllm-endpoint URL --on-missing
generate --hidden-states-backend fp8` runs it (speculators/train/cli.py `main`), step by step so
that a test can look between the steps: the options parsed by its `TrainConfig`, the EAGLE-3 draft
built by its `build_draft_model`, the loaders by its `create_train_val_loaders` (ArrowDataset,
CollateFn, shift_batch, the fp8 backend's transfer), the optimizers, scheduler and step by its
`Trainer`.

On a machine without an accelerator two of its defaults have no CPU kernel, and the options name
speculators' own alternatives: flex attention has no backward on the CPU (`--draft-attn-impl
sdpa`), the fused losses are Triton kernels (`--loss-implementation eager`). Its Trainer assumes
an accelerator in three places, which `cpu_trainer` points at the CPU (see there)."""

from __future__ import annotations

import argparse
import logging

import torch


def train_options(*argv: str) -> argparse.Namespace:
    """`speculators train ARGV`'s options, resolved by its own config and flattened as its main does."""
    from speculators.train.config import TrainConfig

    return argparse.Namespace(**TrainConfig.resolve(list(argv)).flatten())


def build_draft(args: argparse.Namespace):
    """The draft as main builds it: its seed, its vocabulary mappings (none given: the verifier's
    whole vocabulary), then the model class's `from_training_args`, which loads the verifier's
    embeddings, final norm and lm_head."""
    from speculators.train import cli

    cli.set_seed(args.seed)
    d2t, t2d, draft_vocab_size = cli.parse_vocab_mappings(args)
    model_class = cli.SpeculatorModel.registry[args.speculator_type]
    return cli.build_draft_model(args, model_class, t2d, d2t, draft_vocab_size)


def loaders(args: argparse.Namespace, draft):
    """main's train and validation loaders: the backend's transfer from the options, each sample
    fetched from `--vllm-endpoint` when its states are missing, shifted for EAGLE-3 and packed."""
    from hs_connectors import HiddenStatesBackend
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.dataloader import create_train_val_loaders

    transfer = HiddenStatesBackend.registry[args.hidden_states_backend].from_train_args(args, args.data_path)
    return create_train_val_loaders(
        data_path=args.data_path, total_seq_len=args.total_seq_len,
        hidden_states_dtype=getattr(torch, args.hidden_states_dtype), transfer=transfer,
        vllm_endpoint=args.vllm_endpoint, on_missing=args.on_missing,
        verifier_name_or_path=args.verifier_name_or_path, request_timeout=args.request_timeout,
        max_retries=args.max_retries, generation_validation_retries=args.generation_validation_retries,
        max_consecutive_generation_failures=args.max_consecutive_generation_failures,
        hidden_size=draft.config.transformer_layer_config.hidden_size,
        num_target_layers=len(draft.target_layer_ids), num_workers=args.num_workers,
        prefetch_factor=args.prefetch_factor, preprocess=shift_batch, train_data_ratio=args.train_data_ratio,
        seed=args.seed,
    )


def documents(batch: dict):
    """Each document packed in a collated batch, but those the shift left empty (a one-token
    sample): its input ids and its verifier's last states."""
    document_ids = batch["document_ids"][0]
    for document in range(int(document_ids.max()) + 1):
        where = document_ids == document
        if where.any():
            yield batch["input_ids"][0, where].tolist(), batch["verifier_last_hidden_states"][0, where]


class MetricLog(logging.Handler):
    """The metrics the Trainer logs after each step to `speculators.metrics` (its loss among them)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.steps: list[dict] = []

    def emit(self, record):
        if isinstance(record.msg, dict) and "train" in record.msg:
            self.steps.append(record.msg["train"])


def cpu_trainer(args: argparse.Namespace, draft, loader, monkeypatch):
    """speculators' Trainer with the TrainerConfig main builds. Where it assumes an accelerator:
    it places the model and each batch on `get_local_rank()`, an accelerator's index (here the
    CPU); its step timer waits for the accelerator, of which the CPU has nothing to wait for; and
    with no accelerator it names `cuda` to autocast, which then turns itself off (here `cpu`, so
    the step runs in `--hidden-states-dtype` as on a GPU)."""
    import speculators.train.trainer as trainer_module
    from speculators.models.eagle3.core import Eagle3DraftModel

    monkeypatch.setattr(trainer_module, "get_local_rank", lambda: "cpu")
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: None)
    train_call_kwargs, val_call_kwargs = Eagle3DraftModel.get_trainer_kwargs(**vars(args))
    config = trainer_module.TrainerConfig(
        num_epochs=args.epochs, save_path=args.save_path, lr=args.lr,
        resume_from_checkpoint=not args.no_resume_from_checkpoint,
        train_call_kwargs=train_call_kwargs, val_call_kwargs=val_call_kwargs, optimizer=args.optimizer,
        weight_decay=args.weight_decay, muon_lr=args.muon_lr, muon_momentum=args.muon_momentum,
        muon_weight_decay=args.muon_weight_decay, muon_ns_steps=args.muon_ns_steps,
        muon_adjust_lr_fn=args.muon_adjust_lr_fn, scheduler_type=args.scheduler_type,
        scheduler_warmup_steps=args.scheduler_warmup_steps, scheduler_warmup_ratio=args.scheduler_warmup_ratio,
        scheduler_total_steps=args.scheduler_total_steps,
        scheduler_num_cosine_cycles=args.scheduler_num_cosine_cycles, checkpoint_freq=args.checkpoint_freq,
        save_best=args.save_best, hidden_states_dtype=getattr(torch, args.hidden_states_dtype),
        log_freq=args.log_freq, fsdp_shard=args.fsdp_shard, gradient_checkpointing=args.gradient_checkpointing,
        max_steps=args.max_steps,
    )
    trainer = trainer_module.Trainer(draft, config, loader, None)
    trainer.device_type = "cpu"
    return trainer


def train_epoch(trainer) -> list[dict]:
    """One epoch of the Trainer's own step loop; the metrics it logged, one dict a step."""
    log = MetricLog()
    logger = logging.getLogger("speculators.metrics")
    level = logger.level
    logger.addHandler(log)
    logger.setLevel(logging.INFO)
    try:
        trainer.train_epoch(0)
    finally:
        logger.removeHandler(log)
        logger.setLevel(level)
    return log.steps
