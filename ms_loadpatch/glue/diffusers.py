"""Hooks the loading strategy into mindone.diffusers (wrappers for targets.TARGETS)."""


def from_pretrained(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


def from_config(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


def half(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


def float_(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


def to(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


def load_state_dict(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)
