"""Where each captured layer comes from, for the model a worker built (corecap/_vllm/worker.py
installs the capture with it)."""

from __future__ import annotations

from corecap.config import PRENORM


def _decoder(model):
    """The module holding the decoder layers, found as SupportsEagle3.set_aux_hidden_state_layers
    finds the one it gives the layers to."""
    if hasattr(model, "get_language_model"):
        holder = model.get_language_model()
    else:
        holder = getattr(model, "language_model", model)
    return getattr(holder, "model", holder)


def model_num_layers(model) -> int:
    return len(_decoder(model).layers)


class LayerSources:
    """Where each requested layer comes from, for the model this worker built.

    Aux index k (1 <= k < N) is HF's hidden_states[k] on every capture path: vLLM's
    EagleModelMixin and corecap's override record the residual stream after k layers; DeepSeek's
    own code records it before layer k runs; vLLM's Transformers backend records HF decoder
    layer k-1's output. Aux index N is the pre-norm final state on all of them (PRENORM), and
    N itself, after the final norm, is the model's main output. Layer 0 is aux 0 where the
    aux code is the mixin's (which also keeps a scale some models apply after their
    `embed_input_ids`, e.g. Granite's embedding multiplier); elsewhere aux 0 fails (DeepSeek:
    `hidden_states + None`; the Transformers backend: no layer -1) and corecap takes the
    embeddings itself, `embed_input_ids`, which those models' forward passes start from."""

    def __init__(self, model, layers: tuple, num_layers: int):
        from vllm.model_executor.models.interfaces import EagleModelMixin

        self.layers, self.num_layers = layers, num_layers
        self.embed_layer0 = 0 in layers and not isinstance(_decoder(model), EagleModelMixin)
        aux = {num_layers if k == PRENORM else k for k in layers if k == PRENORM or k < num_layers}
        if self.embed_layer0:
            aux.discard(0)
        self.aux_layers = tuple(sorted(aux))

    def select(self, hidden, aux: list, embedded) -> list:
        """The requested layers' tensors, in the requested order."""
        if len(aux) != len(self.aux_layers):
            raise RuntimeError(
                f"the model returned {len(aux)} auxiliary hidden states for the {len(self.aux_layers)} "
                f"corecap asked for (aux layers {list(self.aux_layers)})"
            )
        by_aux = dict(zip(self.aux_layers, aux))
        out = []
        for k in self.layers:
            if k == PRENORM:
                out.append(by_aux[self.num_layers])
            elif k == self.num_layers:
                out.append(hidden)
            elif k == 0 and self.embed_layer0:
                out.append(embedded)
            else:
                out.append(by_aux[k])
        return out

    def describe(self) -> str:
        parts = [f"aux {list(self.aux_layers)}" if self.aux_layers else "no aux"]
        if self.num_layers in self.layers:
            parts.append(f"{self.num_layers} from the main output")
        if self.embed_layer0:
            parts.append("0 from embed_input_ids")
        return ", ".join(parts)
