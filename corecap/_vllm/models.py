"""corecap's own EAGLE-3 auxiliary outputs for vLLM decoders that have none (Gemma 2/3, Mixtral,
Qwen2-MoE, GLM-4, GLM-4-MoE, ...).

vLLM builds them through its `model_class_overrides` (an EngineArgs field, part of the config's
hash): the architecture's name maps to `corecap._vllm.models:Capture__<module>__<Class>`, a
subclass of vLLM's own class made here when vLLM first looks that name up (in the driver and in
every worker). The subclass's decoder gets a forward pass that is vLLM's own residual loop with
the mixin's aux recording added, so its semantics are those of every EAGLE-3 model (aux k = the
residual stream after k layers: 0 = embeddings, N = the pre-norm final state). The decoder
subclass inherits `@support_torch_compile`, so it is the new forward that gets compiled; patching
a forward after the model is built is silently ignored under torch.compile.

Only classes whose own forward is, statement for statement, the loop this module re-creates get
a subclass (`why_not`): anything else there (an all-gather, a scale, a different layer call)
would be lost, so those are refused instead of captured wrongly.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
import types
from itertools import islice

from vllm.distributed import get_pp_group
from vllm.sequence import IntermediateTensors

from corecap._vllm import vllm_source

PREFIX = "Capture__"
_MODELS = "vllm.model_executor.models"

# vLLM's decoder forward that the override re-creates (as in Gemma2/3, Mixtral, Qwen2-MoE,
# GLM-4-MoE in vLLM 0.26 and 0.32); `**kwargs` is Gemma 3's, passed on to its layers.
_STANDARD_LOOP = '''
def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None{kw}):
    if get_pp_group().is_first_rank:
        if inputs_embeds is not None:
            hidden_states = inputs_embeds
        else:
            hidden_states = self.embed_input_ids(input_ids)
        residual = None
    else:
        assert intermediate_tensors is not None
        hidden_states = intermediate_tensors["hidden_states"]
        residual = intermediate_tensors["residual"]
    for layer in islice(self.layers, self.start_layer, self.end_layer):
        hidden_states, residual = layer(positions, hidden_states, residual{kwcall})
    if not get_pp_group().is_last_rank:
        return IntermediateTensors({{"hidden_states": hidden_states, "residual": residual}})
    hidden_states, _ = self.norm(hidden_states, residual)
    return hidden_states
'''
# The outer class's forward: the decoder's output, unchanged (so the aux list reaches the runner).
_PASS_THROUGH = '''
def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None{kw}):
    hidden_states = self.model(input_ids, positions, intermediate_tensors, inputs_embeds{kwcall})
    return hidden_states
'''


def _body(source: str) -> str:
    """A function's statements, as an AST dump without docstring or annotations."""
    fn = vllm_source.parse(textwrap.dedent(source)).body[0]
    body = (fn.body[1:] if fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant)
            else fn.body)
    args = [a.arg for a in fn.args.args] + ([f"**{fn.args.kwarg.arg}"] if fn.args.kwarg else [])
    return f"{args} " + " ".join(ast.dump(s) for s in body)


def _variants(template: str) -> set[str]:
    return {_body(template.format(kw=kw, kwcall=call)) for kw, call in (("", ""), (", **kwargs", ", **kwargs"))}


def _matches(fn, template: str) -> bool:
    try:
        return _body(inspect.getsource(fn)) in _variants(template)
    except (OSError, TypeError, SyntaxError, IndexError):
        return False


def _decoder_class(cls):
    """(module, name) of the decoder class `cls.__init__` builds as `self.model = Name(...)`."""
    module = inspect.getmodule(cls)
    try:
        tree = vllm_source.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    except (OSError, TypeError, SyntaxError):
        return module, None
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and ast.unparse(node.targets[0]) == "self.model"
                and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)):
            return module, node.value.func.id
    return module, None


def why_not(cls) -> str | None:
    """Why corecap cannot give `cls` auxiliary outputs, or None when it can."""
    from vllm.model_executor.models.interfaces import EagleModelMixin

    module, name = _decoder_class(cls)
    if module is None or not module.__name__.startswith(_MODELS + ".") or module.__name__.count(".") != 3:
        return f"{cls.__name__} is not one of vLLM's own model classes"
    decoder = getattr(module, name, None) if name else None
    if not isinstance(decoder, type):
        return f"{cls.__name__} does not build its decoder as `self.model = ...Model(...)`"
    if not _matches(cls.forward, _PASS_THROUGH):
        return f"{cls.__name__}.forward does more than return its decoder's output"
    if not issubclass(decoder, EagleModelMixin) and not _matches(decoder.forward, _STANDARD_LOOP):
        return f"{decoder.__name__}.forward is not the standard residual loop corecap can add auxiliary outputs to"
    return None


def override_target(cls) -> str:
    """The `model_class_overrides` value that builds corecap's subclass of `cls`."""
    return f"{__name__}:{PREFIX}{cls.__module__.rsplit('.', 1)[1]}__{cls.__name__}"


def is_override(cls) -> bool:
    return cls.__module__ == __name__ and cls.__name__.startswith(PREFIX)


def _capture_forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
    """_STANDARD_LOOP with EagleModelMixin's aux recording: after k layers, for each k asked."""
    if get_pp_group().is_first_rank:
        if inputs_embeds is not None:
            hidden_states = inputs_embeds
        else:
            hidden_states = self.embed_input_ids(input_ids)
        residual = None
    else:
        assert intermediate_tensors is not None
        hidden_states = intermediate_tensors["hidden_states"]
        residual = intermediate_tensors["residual"]
    aux = []
    if get_pp_group().is_first_rank:
        self._maybe_add_hidden_state(aux, self.start_layer, hidden_states, residual)
    for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer), start=self.start_layer):
        hidden_states, residual = layer(positions, hidden_states, residual, **kwargs)
        self._maybe_add_hidden_state(aux, idx + 1, hidden_states, residual)
    if not get_pp_group().is_last_rank:
        return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
    hidden_states, _ = self.norm(hidden_states, residual)
    return (hidden_states, aux) if aux else hidden_states


def _own_forward(qualname: str):
    """A code object of its own per class: Dynamo caches compiled code by code object, and
    vLLM's compile wrapper swaps `type(self).forward.__code__` while it runs compiled bytecode."""
    code = _capture_forward.__code__
    code = code.replace(co_name="forward", **({"co_qualname": qualname} if hasattr(code, "co_qualname") else {}))
    forward = types.FunctionType(code, _capture_forward.__globals__, "forward", _capture_forward.__defaults__)
    forward.__qualname__ = qualname
    return forward


def _build(name: str):
    from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3

    module_name, _, class_name = name[len(PREFIX):].rpartition("__")
    module = importlib.import_module(f"{_MODELS}.{module_name}")
    base = getattr(module, class_name)
    reason = why_not(base)
    if reason:
        raise ImportError(f"corecap cannot capture {class_name}: {reason}")
    _, decoder_name = _decoder_class(base)
    decoder_base = getattr(module, decoder_name)
    if issubclass(decoder_base, EagleModelMixin):  # the decoder records aux states already (GLM-4)
        decoder = decoder_base
    else:
        decoder_qualname = f"{PREFIX}{module_name}__{decoder_name}"
        decoder = type(decoder_qualname, (decoder_base, EagleModelMixin), {
            "forward": _own_forward(f"{decoder_qualname}.forward"), "__module__": __name__,
            "__qualname__": decoder_qualname,
        })
        globals()[decoder_qualname] = decoder

    def __init__(self, *, vllm_config, prefix: str = ""):
        # vLLM's __init__ builds its decoder by the module's global name: point it at ours meanwhile.
        setattr(module, decoder_name, decoder)
        try:
            base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        finally:
            setattr(module, decoder_name, decoder_base)

    return type(name, (base, SupportsEagle3), {"__init__": __init__, "__module__": __name__, "__qualname__": name})


def __getattr__(name: str):
    if not name.startswith(PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = globals().get(name) or _build(name)
    globals()[name] = cls
    return cls
