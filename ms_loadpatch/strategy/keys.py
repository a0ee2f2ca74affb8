"""A checkpoint's keys converted to the model's names, with the lookups of
the library code it stands in for (fingerprinted by the glue), in the same
(popitem) order; a mapped value goes through `map_value(mapping, tensor, key)`."""

from __future__ import annotations


def prefixed_keys(state_dict: dict, mappings: dict, model_keys, prefix: str, map_value) -> dict:
    """Each key as it is, without `prefix.`, or with it: the first form the mappings or the model know."""
    length = len(prefix) + 1
    converted = {}
    while state_dict:
        key, value = state_dict.popitem()
        if key in mappings or key in model_keys:
            name = key
        elif key[length:] in mappings or key[length:] in model_keys:
            name = key[length:]
        else:
            joined = ".".join([prefix, key])
            name = joined if joined in mappings or joined in model_keys else key
        entry = mappings.get(name)
        if entry is None:
            converted[name] = value
            continue
        name_ms, mapping = entry
        value = map_value(mapping, value, key) if mapping is not None else value
        if name_ms is not None:
            converted[name_ms] = value
    return converted


def mapped_keys(state_dict: dict, mappings: dict, map_value) -> dict:
    """Each key as its mapping names it, or as it is."""
    converted = {}
    while state_dict:
        key, value = state_dict.popitem()
        name_ms, mapping = mappings.get(key, (key, None))
        if mapping is not None:
            value = map_value(mapping, value, key)
        if name_ms is not None:
            converted[name_ms] = value
    return converted
