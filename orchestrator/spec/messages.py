"""Validation messages that name the field to fix: pydantic's errors as the spec's dotted paths, an unknown
field with the close or valid names next to it, and fields other tools spell differently."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ValidationError


def _field_path(loc: Sequence[Any], raw: Any) -> str:
    """A pydantic error location as the spec's dotted path, without the union tags pydantic inserts."""
    parts: list[str] = []
    node = raw
    for item in loc:
        if isinstance(node, Mapping) and item not in node and node.get("kind") == item:
            continue  # discriminated-union tag, e.g. ('model', 'attention', 'linformer', 'k')
        parts.append(str(item))
        node = node.get(item) if isinstance(node, Mapping) else None
    return ".".join(parts)


# Fields that other tools (or an older layout) spell differently; named in the unknown-field error.
_MOVED_FIELDS = {
    "warmup": "optim.warmup_steps",
    "batch_tokens": "task.batch_size (LM tasks: sequences per worker micro-batch) or task.max_tokens (translation: "
                    "tokens per worker micro-batch), times optim.grad_accum and run.workers per step",
    "batch_size": "task.batch_size",
    "max_tokens": "task.max_tokens",
    "lr_schedule": "optim.schedule",
    "num_heads": "model.attention.heads",
}


def _model_classes(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation may hold (through Optional, unions and Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [cls for arg in get_args(annotation) for cls in _model_classes(arg)]


def _known_fields(root: type[BaseModel], loc: Sequence[Any]) -> list[str]:
    """The field names valid next to the last item of `loc`, walking the models under `root`; a discriminated
    union's tag (e.g. 'linformer' in model.attention.linformer.k) narrows the union to its member."""
    classes: list[type[BaseModel]] = [root]
    for item in loc[:-1]:
        inside = [c for cls in classes if item in cls.model_fields
                  for c in _model_classes(cls.model_fields[item].annotation)]
        if not inside:  # a union tag: keep the members whose `kind` is this literal
            inside = [cls for cls in classes
                      if "kind" in cls.model_fields and item in get_args(cls.model_fields["kind"].annotation)]
        classes = inside
        if not classes:
            return []
    return sorted({name for cls in classes for name in cls.model_fields})


def _other_kinds_hint(root: type[BaseModel], loc: Sequence[Any]) -> str:
    """Where `loc` is a field of a kind-tagged block (loc[-2] the tag) that other kinds of the same union have, the
    hint naming them: `{kind: mha, k: 64}` means Linformer's k, and the field list alone does not say whose it is.
    A projection kind's `mechanism:` union is named too when it has a kind with that field (mha x linformer)."""
    name, tag = str(loc[-1]), loc[-2]
    members = _known_classes(root, loc[:-2])
    own = [cls for cls in members
           if "kind" in cls.model_fields and tag in get_args(cls.model_fields["kind"].annotation)]
    if not own:
        return ""
    owners = [kind for cls in members if cls not in own and name in cls.model_fields
              for kind in get_args(cls.model_fields["kind"].annotation)]
    if not owners:
        return ""
    mechanisms = [kind for cls in own if "mechanism" in cls.model_fields
                  for mech in _model_classes(cls.model_fields["mechanism"].annotation) if name in mech.model_fields
                  for kind in get_args(mech.model_fields["kind"].annotation)]
    hint = f"{name} is a field of kind {' or '.join(owners)}, not of {tag}: set kind: {owners[0]}"
    if mechanisms:
        hint += (f", or keep {tag}'s projections and cross them with it: "
                 f"mechanism: {{kind: {mechanisms[0]}, {name}: ...}}")
    return hint


def _other_kinds_close_hint(root: type[BaseModel], loc: Sequence[Any], known: Sequence[str]) -> str:
    """Where `loc`'s name is close to a field of another kind of the same union only (`{kind: mha, shareing: kv}`),
    the hint naming that field and whose it is."""
    members = _known_classes(root, loc[:-2])
    others = {name for cls in members for name in cls.model_fields} - set(known)
    close = difflib.get_close_matches(str(loc[-1]), sorted(others), n=1, cutoff=0.75)
    hint = _other_kinds_hint(root, [*loc[:-1], close[0]]) if close else ""
    return f"did you mean {close[0]}? {hint}" if hint else ""


def _known_classes(root: type[BaseModel], loc: Sequence[Any]) -> list[type[BaseModel]]:
    """The models a value at `loc` may validate as (every member of a union not yet narrowed by its tag)."""
    classes: list[type[BaseModel]] = [root]
    for item in loc:
        classes = [c for cls in classes if item in cls.model_fields
                   for c in _model_classes(cls.model_fields[item].annotation)]
    return classes


def _unknown_field_message(root: type[BaseModel], loc: Sequence[Any]) -> str:
    name = str(loc[-1])
    hints = []
    if name in _MOVED_FIELDS:
        hints.append(f"this spec calls it {_MOVED_FIELDS[name]}")
    known = _known_fields(root, loc)
    # Another kind's exact field (`{kind: mha, mode: mul}`) beats a close name of this kind (d_model).
    other = _other_kinds_hint(root, loc) if len(loc) >= 2 and not hints else ""
    close = [] if other else difflib.get_close_matches(name, known, n=2, cutoff=0.6)
    if len(loc) >= 2 and not hints and not other and not close:
        other = _other_kinds_close_hint(root, loc, known)
    if close and not hints:
        hints.append("did you mean " + " or ".join(close) + "?")
    if other:
        hints.append(other)
    if known and not close:
        hints.append("valid fields here: " + ", ".join(known))
    hint = ("; " + "; ".join(hints)) if hints else ""
    return f"unknown field{hint} (docs/orchestrator.md lists every block's fields)"


def did_you_mean(name: str, kinds: Sequence[str], cutoff: float = 0.6, most: int = 2) -> str:
    """The hint 'did you mean a or b? ' naming the (at most `most`) kinds close to a misspelt `name`; '' when none
    is close."""
    close = difflib.get_close_matches(name, list(kinds), n=most, cutoff=cutoff)
    return f"did you mean {' or '.join(close)}? " if close else ""


def _unknown_kind_message(ctx: Mapping[str, Any]) -> str:
    """A discriminated union's tag (a block's `kind`) that names no member: the close kinds, then every kind."""
    kinds = [kind.strip().strip("'") for kind in str(ctx["expected_tags"]).split(",")]
    hint = did_you_mean(str(ctx["tag"]), kinds)
    return f"kind={ctx['tag']!r} is not a kind here; {hint}valid kinds: {', '.join(kinds)}"


def _at_block(msg: str, path: str) -> str:
    """`msg` with the fields an attention block's own validator names as model.attention.<field> renamed to where
    the block sits: a `mechanism:` block (model.attention.mechanism.k) or a patch's block (task.patch.attention)."""
    parts = path.split(".")
    if "attention" not in parts:
        return msg
    outer = ".".join(parts[:parts.index("attention") + 1])
    block = outer + ".mechanism" if "mechanism" in parts[parts.index("attention"):] else outer
    msg = re.sub(r"\bmodel\.attention\.mechanism\.", outer + ".mechanism.", msg)
    return re.sub(r"\bmodel\.attention\.(?!mechanism\.)", block + ".", msg)


def describe_errors(err: ValidationError, raw: Mapping[str, Any], root: type[BaseModel]) -> str:
    """One line per error of `raw` validated as `root` (ExperimentSpec), each naming its field."""
    lines = []
    for item in err.errors():
        path = _field_path(item["loc"], raw)
        msg = _at_block(item["msg"].removeprefix("Value error, "), path)
        if item["type"] == "extra_forbidden":
            msg = _unknown_field_message(root, item["loc"])
        elif item["type"] == "union_tag_invalid":
            msg = _unknown_kind_message(item["ctx"])
        elif item["type"] == "missing":
            msg = "required field is missing; add it to the spec"
        elif item["type"] == "finite_number":
            msg = f"must be a finite number (got {item['input']}); NaN and infinity are refused"
        elif item["type"] == "int_from_float":
            msg += ("; this field takes integers: to search it, use {randint: [lo, hi]} (hi excluded) or "
                    "{grid: [...]}, not uniform or loguniform, which draw floats")
        lines.append(f"  {path}: {msg}" if path else f"  {msg}")
    return "\n".join(lines)


def _flat_types(annotation: Any) -> set[Any]:
    """The types an annotation admits, through Optional, unions and Annotated."""
    args = get_args(annotation)
    return {t for arg in args for t in _flat_types(arg)} if args else {annotation}


def _item_types(annotation: Any) -> set[Any]:
    """The item types of the lists an annotation admits (`list[int] | None`: {int}); empty when it admits none."""
    if get_origin(annotation) in (list, tuple):
        return _flat_types(annotation)
    return {t for arg in get_args(annotation) for t in _item_types(arg)}


def booleans_as_numbers(raw: Mapping[str, Any], classes: Sequence[type[BaseModel]], path: str = "") -> list[str]:
    """One line per YAML boolean given to a field that takes a number and not a boolean, or as an item of a list
    of numbers (`tune.seeds: [true]`, named `tune.seeds.0` as pydantic names items), walking `raw` through the
    models of `classes` (ExperimentSpec at the top): pydantic's lax ints read `run.workers: true` as 1 worker and
    `false` as 0, and a spec that says true where it means a count is a slip, not a request."""
    if "kind" in raw:  # a discriminated union's member: the classes whose `kind` literal is this one
        classes = [cls for cls in classes if "kind" not in cls.model_fields
                   or raw["kind"] in get_args(cls.model_fields["kind"].annotation)] or classes
    lines = []
    for key, value in raw.items():
        annotations = [cls.model_fields[key].annotation for cls in classes if key in cls.model_fields]
        where = f"{path}.{key}" if path else str(key)
        if isinstance(value, bool):
            types = {t for a in annotations for t in _flat_types(a)}
            if types & {int, float}:  # (no field admits both a bool and a number)
                lines.append(f"  {where}: {str(value).lower()} is a boolean, and this field takes a number; "
                             "write the number")
        elif isinstance(value, list):
            items = {t for a in annotations for t in _item_types(a)}
            if items & {int, float} and bool not in items:
                lines += [f"  {where}.{i}: {str(item).lower()} is a boolean, and this field takes a list of numbers "
                          f"(it would be read as {int(item)}); write the number"
                          for i, item in enumerate(value) if isinstance(item, bool)]
        elif isinstance(value, Mapping):
            inner = [c for a in annotations for c in _model_classes(a)]
            lines += booleans_as_numbers(value, inner, where) if inner else []
    return lines
