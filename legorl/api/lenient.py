"""Documents read leniently through the API's own models: the one reader for what may not validate.

The UI shows what an older or a newer operator wrote, and a run store's `run.json` whatever wrote it;
diagnostics explains runs whose spec the API server may never have checked. Neither may fail on one bad
value: unknown fields are ignored, values are coerced where they can be (`"3"` for 3), and a field that
still does not validate keeps its default (an object is then read field by field, a list item that does not
validate is left out). What is read is the API's own type, never a key spelled by the reader.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Final, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, TypeAdapter, ValidationError

__all__ = ["lenient", "partial", "read_field", "reported", "status_of"]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

_UNREAD: Final = object()
"""A field that `raw` does not give, or gives so that not even its parts can be read."""


def lenient(model: type[M], raw: object) -> M | None:
    """`raw` (a spec or status as JSON, camelCase) read as `model`, as far as it validates (see the module's
    docstring); None when it is not an object or a required field cannot be read. The result's
    `model_fields_set` holds the fields `raw` gave (see `reported`)."""
    if not isinstance(raw, Mapping):
        return None
    try:
        return model.model_validate(raw, strict=False, extra="ignore")
    except ValidationError as exc:
        log.debug(
            "%s: %d field(s) do not validate; reading it field by field", model.__name__, exc.error_count()
        )
    good = {}
    for name in model.model_fields:
        value = _field(model, name, raw)
        if value is not _UNREAD:
            good[name] = value
    try:
        return model.model_validate(good, strict=False, by_name=True)
    except ValidationError as exc:  # a required field is missing or unreadable
        log.debug("%s cannot be read: %s", model.__name__, exc)
        return None


def partial(model: type[M], raw: object) -> M:
    """As `lenient`, for a reader that wants every value it can get even when the whole does not validate:
    a required field that cannot be read stays unset (reading it raises AttributeError: check `reported`
    first) instead of making the result None, and an object field is read the same way (a pool without its
    required `source` still gives its other settings); a `raw` that is not an object gives the defaults.
    Nothing is validated as a whole: use it to read, never to accept."""
    if isinstance(raw, Mapping):
        try:
            return model.model_validate(raw, strict=False, extra="ignore")
        except ValidationError as exc:
            log.debug("%s: %d field(s) do not validate; reading what does", model.__name__, exc.error_count())
    values: dict[str, Any] = {}
    if isinstance(raw, Mapping):
        for name in model.model_fields:
            value = _field(model, name, raw, partial)
            if value is not _UNREAD:
                values[name] = value
    return model.model_construct(_fields_set=set(values), **values)


def read_field(model: type[BaseModel], raw: object, name: str) -> Any:
    """Field `name` of `model` as `raw` (an object of that model, as JSON) gives it, read leniently; None
    when `raw` does not give it or it cannot be read (not the model's default: a spec that does not say is
    not a spec that says the default). For the sections of a spec whose other parts may be missing (a run
    store's `run.json` need not be a whole RLRun)."""
    value = _field(model, name, raw) if isinstance(raw, Mapping) else _UNREAD
    return None if value is _UNREAD else value


def status_of(model: type[M], body: Mapping[str, Any] | None) -> M:
    """The status of the object `body` (a whole resource as the API server holds it) read as `model`; the
    model's defaults when it has none or it cannot be read (a status's fields all have defaults)."""
    status = lenient(model, (body or {}).get("status"))
    return model() if status is None else status


def reported(obj: BaseModel, name: str) -> bool:
    """Whether the JSON `obj` was read from gave field `name` (its default then is the model's, not a
    report: the UI keeps what else it knows). KeyError for a name the model does not have."""
    if name not in type(obj).model_fields:
        raise KeyError(f"{type(obj).__name__} has no field {name!r}")
    return name in obj.model_fields_set


def _field(
    model: type[BaseModel],
    name: str,
    raw: Mapping[str, Any],
    read: Callable[..., BaseModel | None] | None = None,
) -> Any:
    """Field `name` as `raw` gives it, validated alone; what can be read of it when it does not validate
    (an object through `read`, `lenient` unless told); `_UNREAD` when `raw` does not give it."""
    info = model.model_fields[name]
    key = info.alias or name
    if key not in raw:
        return _UNREAD
    value = raw[key]
    try:
        return _adapter(model, name).validate_python(value, strict=False, extra="ignore")
    except ValidationError as exc:
        log.debug("%s.%s does not validate: %s", model.__name__, key, exc)
    return _salvage(info.annotation, value, _adapter(model, name), read or lenient)


def _salvage(
    annotation: Any, value: Any, adapter: TypeAdapter[Any], read: Callable[..., BaseModel | None]
) -> Any:
    """What can be read of a value that does not validate: an object field by field, a list of objects
    without the items that cannot be read; `_UNREAD` for anything else."""
    inner = _model_in(annotation)
    if inner is None:
        return _UNREAD
    if isinstance(value, list) and _is_list(annotation):
        items = [item for item in (lenient(inner, v) for v in value) if item is not None]
        try:
            return adapter.validate_python(items, strict=False)
        except ValidationError as exc:  # the list's own bounds
            log.debug("%s items do not validate as a list: %s", inner.__name__, exc)
            return _UNREAD
    if not isinstance(value, Mapping):
        return _UNREAD  # not even an object: nothing of it can be read
    found = read(inner, value)
    return _UNREAD if found is None else found


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model in `M`, `M | None` or `list[M]`, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = get_origin(annotation)
    if origin is Annotated:
        return _model_in(get_args(annotation)[0])
    if origin is list or origin is Union or origin is types.UnionType:
        models = [m for m in (_model_in(a) for a in get_args(annotation)) if m is not None]
        return models[0] if len(models) == 1 else None
    return None


def _is_list(annotation: Any) -> bool:
    """Whether `annotation` is a list, or an optional one."""
    origin = get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        return any(_is_list(a) for a in get_args(annotation) if a is not type(None))
    return origin is list


@functools.cache
def _adapter(model: type[BaseModel], name: str) -> TypeAdapter[Any]:
    """A validator of one field of `model`, with the field's constraints."""
    info = model.model_fields[name]
    annotation: Any = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    return TypeAdapter(annotation)
