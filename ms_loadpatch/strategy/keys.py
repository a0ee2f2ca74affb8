"""A checkpoint's keys converted to the model's names, with the lookups of
the library code it stands in for (fingerprinted by the glue), in the same
(popitem) order; a mapped value goes through `map_value(mapping, tensor, key)`."""

from __future__ import annotations


def prefixed_keys(state_dict: dict, mappings: dict, model_keys, prefix: str, map_value) -> dict:
    """Each key as it is, without `prefix.`, or with it: the first form the mappings or the model know."""
    length = len(prefix) + 1

    def name_of(key):
        if key in mappings or key in model_keys:
            return key
        if key[length:] in mappings or key[length:] in model_keys:
            return key[length:]
        joined = ".".join([prefix, key])
        return joined if joined in mappings or joined in model_keys else key

    return _converted(state_dict, mappings, name_of, map_value)


def mapped_keys(state_dict: dict, mappings: dict, map_value) -> dict:
    """Each key as its mapping names it, or as it is."""
    return _converted(state_dict, mappings, lambda key: key, map_value)


def _converted(state_dict, mappings, name_of, map_value) -> dict:
    converted = {}
    while state_dict:
        key, value = state_dict.popitem()
        name = name_of(key)
        name_ms, mapping = mappings.get(name, (name, None))
        if mapping is not None:
            value = map_value(mapping, value, key)
        if name_ms is not None:
            converted[name_ms] = value
    return converted
