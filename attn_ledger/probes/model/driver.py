"""Where a scanned model runs (the worker), and the tool's side that asks it to run and receives its calls.

The worker builds the model (:func:`setup`: :func:`attn_ledger.probes.model.targets.build`) and keeps
it. On a ``scan`` request (:func:`serve`) it runs one forward on the inputs sent (or the factory's own)
under :class:`~attn_ledger.probes.model.capture.Capture`, sending each attention call back as it
returns: plain facts and raw tensors, through ``send(facts, tensors)``. An attention module whose
forward made no interface call is watched by the function-mode observer in a second forward of the
same inputs (the model is deterministic in eval mode), its calls numbered as in the first.
Nothing here judges: the tool's process does, on what comes back.

:class:`LocalModel` runs the same in the tool's own process (``--in-process``, the pytest helper);
:class:`RemoteModel` is the tool's handle on a model in the worker. Both give ``facts`` (what the model
is: its type, config, architecture, implementation, attention modules) and ``scan(inputs, sink)``.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from attn_ledger.errors import first_line
from attn_ledger.guard import UserCodeError, user_call
from attn_ledger.probes.model.expect import ENCODERS

if TYPE_CHECKING:
    from torch import Tensor, nn

Sink = Callable[[dict[str, Any], dict[str, "Tensor"]], None]


# --- what the model is ---------------------------------------------------------------------------


def _architecture(model: Any) -> str:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return "module"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder"
    if getattr(config, "model_type", "") in ENCODERS and not getattr(config, "is_decoder", False):
        return "encoder"
    return "decoder"


def _accepts(model: Any, name: str) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


LEARNED_POSITIONS = ("embed_positions", "position_embeddings", "wpe")
"""Names of the modules that hold learned absolute position embeddings (BART, BERT, GPT-2)."""


def model_facts(model: "nn.Module", given: Any, label: str) -> dict[str, Any]:
    """What the judge reads of the model, as plain data (its config through ``to_json_string``)."""
    import torch

    from attn_ledger.probes.model.capture import attention_modules

    config = getattr(model, "config", None)
    arch = _architecture(model)
    facts: dict[str, Any] = {"label": label, "class": type(model).__name__, "architecture": arch,
                             "attention_modules": list(attention_modules(model)), "given_inputs": _given(given)}
    if arch != "module":
        facts["config"] = json.loads(config.to_json_string(use_diff=False))
        facts["model_type"] = str(getattr(config, "model_type", ""))
        facts["implementation"] = getattr(config, "_attn_implementation", None)
        for key in ("vocab_size", "pad_token_id", "decoder_start_token_id"):
            value = getattr(config, key, None)
            facts[key] = value if isinstance(value, int) else None
        facts["takes_position_ids"] = _accepts(model, "position_ids")
        facts["takes_use_cache"] = _accepts(model, "use_cache")
        facts["learned_positions"] = [n for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in LEARNED_POSITIONS
                                      and isinstance(getattr(m, "weight", None), torch.Tensor)]
    params = [p for p in model.parameters() if p.is_floating_point()]
    facts["dtype"] = str(params[0].dtype).removeprefix("torch.") if params else "float32"
    facts["layers"] = len(facts["attention_modules"])
    return facts


GIVEN_SIDES = ("attention_mask", "position_ids", "decoder_input_ids")
MAX_GIVEN_SIDE = 1 << 20  # the given inputs' masks and positions go to the judge as lists up to this many entries


def _given(given: Any) -> Any:
    """The factory's inputs described (each tensor's shape), with the tensors that say which positions are real
    (``attention_mask``, ``position_ids``, ``decoder_input_ids``) as lists, for the judge."""
    import torch

    if given is None:
        return None
    if isinstance(given, torch.Tensor):
        return {"tensor": list(given.shape)}
    out: dict[str, Any] = {k: (list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__) for k, v in given.items()}
    sides = {k: given[k].tolist() for k in GIVEN_SIDES
             if isinstance(given.get(k), torch.Tensor) and given[k].dim() == 2 and given[k].numel() <= MAX_GIVEN_SIDE
             and not given[k].is_floating_point()}
    if sides:
        out["sides"] = sides
    return out


# --- one forward, its calls sent as they return -------------------------------------------------------


@dataclass
class Loaded:
    """The worker's state: the model, the inputs its factory gave (or None), and its facts."""

    model: Any
    given: Any
    facts: dict[str, Any]


def run_scan(loaded: Loaded, inputs: "Mapping[str, Tensor] | None", sink: Sink) -> dict[str, Any]:
    """The forward under capture (a second one for modules the interface did not see); returns its facts:
    ``calls``, ``unseen`` (``[entry, path]`` never observed) and ``error`` (what the forward raised)."""
    import torch

    from attn_ledger.probes.model.capture import Capture

    model = loaded.model
    interface = loaded.facts["architecture"] != "module"
    args = _forward_args(loaded, inputs)
    out: dict[str, Any] = {"calls": 0, "unseen": [], "passes": 1}
    with torch.no_grad():
        modules = None
        if not interface:  # a model of one's own: its attention modules are those whose calls show a core
            modules = _discover(model, args, loaded.facts["label"])
            out["discovered"] = list(modules)
        cap = Capture(model, sink, interface=interface, modules=modules)
        error = _forward(cap, model, args, loaded.facts["label"])
        out["calls"], unseen = cap.calls, cap.unseen
        if error is None and unseen and interface and not _decoding(args[1]):  # a second forward would grow a live cache
            out["passes"] = 2
            again = Capture(model, sink, watch=frozenset(p for _, p in unseen))
            again.calls = cap.calls
            error = _forward(again, model, args, loaded.facts["label"])
            out["calls"] = again.calls
            seen_now = {p for _, p in unseen} - {p for _, p in again.unseen}
            unseen = [u for u in unseen if u[1] not in seen_now] + [u for u in again.unseen if u[1] not in seen_now
                                                                   and u not in unseen]
    out["unseen"] = unseen
    if error is not None:
        out["error"] = error
    return out


def scan_forward(model: Any, facts: dict[str, Any], inputs: "Mapping[str, Tensor]", sink: Sink) -> dict[str, Any]:
    """:func:`run_scan` of a model built elsewhere (a compare's run) on the inputs given."""
    return run_scan(Loaded(model, None, facts), inputs, sink)


def _forward_args(loaded: Loaded, inputs: "Mapping[str, Tensor] | None") -> tuple[tuple, dict]:
    import torch

    if inputs is None:
        given = loaded.given
        return ((given,), {}) if isinstance(given, torch.Tensor) else ((), dict(given))
    kwargs = dict(inputs)
    if loaded.facts.get("takes_use_cache") and "use_cache" not in kwargs:  # a decode step brings its own cache
        kwargs["use_cache"] = False
    return (), kwargs


def _decoding(kwargs: Mapping[str, Any]) -> bool:
    """Whether a forward's keyword arguments decode through a live cache (``use_cache=True``)."""
    return kwargs.get("use_cache") is True


def _discover(model: Any, args: tuple[tuple, dict], label: str) -> dict[str, Any]:
    from attn_ledger.probes.model.capture import discover

    def run() -> None:
        with user_call(f"the forward of {label} (finding its attention modules)"):
            model(*args[0], **args[1])

    try:
        return discover(model, run)
    except Exception:  # the forward raised: the scan's own forward says so
        return {}


def _forward(cap: Any, model: Any, args: tuple[tuple, dict], label: str) -> dict[str, Any] | None:
    """One forward under ``cap``; what it raised (or how it ended) as data, None where it returned."""
    try:
        with cap, user_call(f"the forward of {label}"):
            model(*args[0], **args[1])
    except UserCodeError as exc:
        return {"text": f"the forward of {label} {exc}", **exc.facts(), "in": cap.raised_in}
    except Exception as exc:  # the model's own code (or a registered function) raised: the scan reports it
        return {"text": f"the forward of {label} raised {type(exc).__name__}: {first_line(exc)}",
                "exception": type(exc).__name__, "message": first_line(exc), "in": cap.raised_in}
    return None


# --- the worker's side -----------------------------------------------------------------------------------


def setup(args: dict[str, Any]) -> tuple[Loaded, dict[str, Any]]:
    """Build the target (user code runs here only) and say what it is."""
    from attn_ledger.probes.model.targets import Target, build

    if "target_b" in args:  # compare: two runs of one model
        from attn_ledger.probes.model.pair import setup as pair_setup

        return pair_setup(args, model_facts)  # type: ignore[return-value]
    t = Target.from_json(args["target"])
    model, given = build(t)
    facts = model_facts(model, given, t.label)
    if facts["architecture"] == "module" and given is None:
        from attn_ledger.errors import SetupError

        raise SetupError(f"target: {t.source}() returned a {facts['class']} without inputs, expected "
                         "(module, inputs) for a model that is not transformers'")
    return Loaded(model, given, facts), {"units": [0], "model": facts}


def serve(loaded: Loaded, kind: str, meta: dict[str, Any], tensors: dict[str, "Tensor"],
          send: Sink) -> tuple[dict[str, Any], dict[str, "Tensor"]]:
    """One request of the tool's: ``scan`` (the inputs sent, or none for the factory's own)."""
    import torch

    if torch.get_num_threads() != meta["threads"]:
        torch.set_num_threads(meta["threads"])
    if kind == "compare":
        from attn_ledger.probes.model.pair import run_compare

        return run_compare(loaded, *split_sides(tensors), send), {}  # type: ignore[arg-type]
    if kind == "compare_calls":
        from attn_ledger.probes.model.pair import run_calls

        return run_calls(loaded, *split_sides(tensors), int(meta["block"]), send, scan_forward,  # type: ignore[arg-type]
                         int(meta.get("example", 0))), {}
    if kind != "scan":
        raise ValueError(f"the model driver has no request {kind!r}")
    return run_scan(loaded, tensors if meta.get("inputs") == "sent" else None, send), {}


def split_sides(tensors: Mapping[str, "Tensor"]) -> tuple[dict[str, "Tensor"], dict[str, "Tensor"]]:
    """``compare``'s two runs' inputs, sent as one dict with ``a.`` and ``b.`` before each name."""
    a = {k[2:]: v for k, v in tensors.items() if k.startswith("a.")}
    b = {k[2:]: v for k, v in tensors.items() if k.startswith("b.")}
    return a, b


# --- the tool's side ---------------------------------------------------------------------------------


class LocalModel:
    """A model in this process (``--in-process``, the pytest helper)."""

    def __init__(self, loaded: Loaded) -> None:
        self.loaded = loaded
        self.facts = loaded.facts

    def scan(self, inputs: "Mapping[str, Tensor] | None", sink: Sink) -> dict[str, Any]:
        return run_scan(self.loaded, inputs, sink)

    def compare(self, inputs_a: "Mapping[str, Tensor]", inputs_b: "Mapping[str, Tensor]", sink: Sink) -> dict[str, Any]:
        from attn_ledger.probes.model.pair import run_compare

        return run_compare(self.loaded, inputs_a, inputs_b, sink)  # type: ignore[arg-type]

    def compare_calls(self, inputs_a: "Mapping[str, Tensor]", inputs_b: "Mapping[str, Tensor]", block: int,
                      sink: Sink, example: int = 0) -> dict[str, Any]:
        from attn_ledger.probes.model.pair import run_calls

        return run_calls(self.loaded, inputs_a, inputs_b, block, sink, scan_forward, example)  # type: ignore[arg-type]


class RemoteModel:
    """The model in the worker: ``scan`` is one request, its calls streamed back to ``sink`` as they return."""

    def __init__(self, sup: Any, facts: dict[str, Any]) -> None:
        self.sup = sup
        self.facts = facts

    def scan(self, inputs: "Mapping[str, Tensor] | None", sink: Sink) -> dict[str, Any]:
        import torch

        from attn_ledger.probes.common.driver import pack, unpack

        def part(facts: dict[str, Any], blob: bytes) -> None:
            sink(facts, unpack(blob))

        meta = {"what": f"the forward of {self.facts['label']}", "threads": torch.get_num_threads(),
                "inputs": "sent" if inputs is not None else "given"}
        facts, _ = self.sup.call_model("scan", meta, pack(dict(inputs or {})), part)
        return facts

    def compare(self, inputs_a: "Mapping[str, Tensor]", inputs_b: "Mapping[str, Tensor]", sink: Sink) -> dict[str, Any]:
        """Both runs and their replays as one request, each block's rows streamed back to ``sink``."""
        import torch

        from attn_ledger.probes.common.driver import pack, unpack

        def part(facts: dict[str, Any], blob: bytes) -> None:
            sink(facts, unpack(blob))

        meta = {"what": f"the forwards of {self.facts['label']}", "threads": torch.get_num_threads()}
        sent = {**{f"a.{k}": v for k, v in inputs_a.items()}, **{f"b.{k}": v for k, v in inputs_b.items()}}
        facts, _ = self.sup.call_model("compare", meta, pack(sent), part)
        return facts

    def compare_calls(self, inputs_a: "Mapping[str, Tensor]", inputs_b: "Mapping[str, Tensor]", block: int,
                      sink: Sink, example: int = 0) -> dict[str, Any]:
        """Each run's attention calls inside one block, as scan captures them, streamed back to ``sink``."""
        import torch

        from attn_ledger.probes.common.driver import pack, unpack

        def part(facts: dict[str, Any], blob: bytes) -> None:
            sink(facts, unpack(blob))

        meta = {"what": f"the forwards of {self.facts['label']} (block {block}'s attention)",
                "threads": torch.get_num_threads(), "block": block, "example": example}
        sent = {**{f"a.{k}": v for k, v in inputs_a.items()}, **{f"b.{k}": v for k, v in inputs_b.items()}}
        facts, _ = self.sup.call_model("compare_calls", meta, pack(sent), part)
        return facts
