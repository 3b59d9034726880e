"""What the pusher settles on from start()'s arguments and the environment: where to push,
how often, with which labels; and the texts a push carries, made acceptable to the agent.
Each function takes `warn`, which reports a setting that was dropped or changed."""

import math
import os

from .limits import (COLLIDING, MAX_LABEL_BYTES, MAX_TEXT, MAX_USER_LABELS, MIN_INTERVAL,
                     RANK_LABELS, is_visible_char, label_problem, label_size, text_problem)

DEFAULT_SOCKET = "/run/gpumem/push.sock"
DEFAULT_URL = "http://127.0.0.1:9417/api/v1/push"
PUSH_PATH = "/api/v1/push"
DEFAULT_INTERVAL = 5.0


class Config:
    """start()'s settled arguments: url (None: resolved for every push), interval, labels."""

    __slots__ = ("url", "interval", "labels")

    def __init__(self, url, interval, labels):
        self.url = url
        self.interval = interval
        self.labels = labels

    @classmethod
    def of(cls, explicit, warn):
        """From start()'s arguments ({"url", "interval", "labels"}, each optional) and the
        environment."""
        url = explicit.get("url")
        return cls(check_url(str(url), "url", warn) if url else None,
                   interval(explicit.get("interval"), warn),
                   labels(explicit.get("labels"), warn))


def clean_text(value, what, warn):
    """Text the agent accepts: other characters removed, spaces trimmed, cut to 128 bytes
    (with a warning); a torch_version or alloc_conf it would refuse would lose every push."""
    if text_problem(value) is None:
        return value
    cleaned = "".join(c for c in value if is_visible_char(c)).strip(" ")
    data = cleaned.encode("utf-8", "surrogatepass")[:MAX_TEXT]
    cleaned = data.decode("utf-8", "ignore").strip(" ")
    warn(f"{what} is not at most {MAX_TEXT} bytes of letters, digits, ASCII punctuation and "
         f"inner spaces; sending {cleaned!r}")
    return cleaned


def alloc_conf(warn):
    """The allocator's settings variables as the agent needs them to tell which one the job's
    release reads: `PYTORCH_CUDA_ALLOC_CONF` as `alloc_conf` where it is set, and
    `PYTORCH_ALLOC_CONF` as `alloc_conf_generic` where it is set and says something else
    (from 2.10 the CUDA variable wins; up to 2.9 the device allocator reads only the CUDA
    one)."""
    cuda = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    generic = os.environ.get("PYTORCH_ALLOC_CONF")
    out = {}
    # Set but empty is set: PyTorch parses the empty string, and the CUDA variable wins.
    if cuda is not None:
        out["alloc_conf"] = clean_text(cuda, "PYTORCH_CUDA_ALLOC_CONF", warn)
    if generic is not None and generic != cuda:
        out["alloc_conf_generic"] = clean_text(generic, "PYTORCH_ALLOC_CONF", warn)
    return out


def _env_labels(warn):
    """(name, value) pairs from GPUMEM_PUSH_LABELS=name=value,name=value."""
    out = []
    for item in os.environ.get("GPUMEM_PUSH_LABELS", "").split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        if not sep:
            warn(f"GPUMEM_PUSH_LABELS: {item.strip()!r} is not name=value; dropped")
            continue
        name = name.strip()
        if any(name == seen for seen, _ in out):
            warn(f"GPUMEM_PUSH_LABELS: {name!r} is given twice; the first value is kept")
            continue
        out.append((name, value.strip()))
    return out


def labels(explicit, warn):
    """The labels pushed: GPUMEM_PUSH_LABELS, then start()'s (which win on a name), checked
    with the agent's rules, at most 8; then the torchrun rank labels not given already."""
    merged = {}
    for name, value in _env_labels(warn):
        merged[name] = value
    if explicit:
        try:
            items = list(explicit.items())
        except Exception:
            warn(f"labels must be a dict of name to value, not {type(explicit).__name__}; "
                 "ignored")
            items = []
        for name, value in items:
            merged[str(name)] = value if isinstance(value, str) else str(value)
    # The rank labels first: they identify the process, and count in the byte total.
    ranks = {}
    for name, variable in RANK_LABELS:
        value = os.environ.get(variable)
        if value is None or name in merged:
            continue
        problem = label_problem(name, value)
        if problem:
            warn(f"label {name!r} (from {variable}) {problem}; dropped")
        else:
            ranks[name] = value
    used = sum(label_size(n, v) for n, v in ranks.items())
    out = {}
    for name, value in merged.items():
        problem = label_problem(name, value)
        # The agent exports a colliding name as exported_<name>: both given would clash.
        base = name[len("exported_"):] if name.startswith("exported_") else None
        if not problem and base in COLLIDING and base in merged:
            problem = f"clashes with {base!r}, which the agent exports as {name!r}"
        if problem:
            warn(f"label {name!r} {problem}; dropped")
        elif len(out) >= MAX_USER_LABELS:
            warn(f"label {name!r} is past the {MAX_USER_LABELS} labels allowed; dropped")
        elif used + label_size(name, value) > MAX_LABEL_BYTES:
            warn(f"label {name!r} is past the {MAX_LABEL_BYTES} bytes the labels may take "
                 "together; dropped")
        else:
            out[name] = value
            used += label_size(name, value)
    out.update(ranks)
    return out


def interval(explicit, warn):
    """Seconds between pushes: start()'s, else GPUMEM_PUSH_INTERVAL, else 5; at least 0.5."""
    if explicit is not None:
        value, source = explicit, "interval"
    elif os.environ.get("GPUMEM_PUSH_INTERVAL", "").strip():
        value, source = os.environ["GPUMEM_PUSH_INTERVAL"].strip(), "GPUMEM_PUSH_INTERVAL"
    else:
        return DEFAULT_INTERVAL
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < MIN_INTERVAL:
        warn(f"{source}={value!r} is not a number of seconds of at least {MIN_INTERVAL}; "
             f"pushing every {DEFAULT_INTERVAL:g} s")
        return DEFAULT_INTERVAL
    return seconds


def check_url(url, source, warn):
    """The URL as sent to, or None (with a warning) if it is neither unix:<path> nor http."""
    url = url.strip()
    if url.startswith("unix:"):
        if len(url) > len("unix:"):
            return url
    else:
        from urllib.parse import urlsplit
        try:
            parts = urlsplit(url)
            if parts.scheme in ("http", "https") and parts.hostname:
                parts.port  # noqa: B018 (raises on a bad port)
                if parts.path in ("", "/"):
                    url = url.rstrip("/") + PUSH_PATH
                return url
        except ValueError:
            pass
    warn(f"{source}={url!r} is neither unix:<socket path> nor an http URL; ignored")
    return None


def resolve_url(explicit, warn):
    """Where the next push goes: start()'s url, else GPUMEM_PUSH_URL, else the agent's socket
    if it exists now, else its loopback HTTP address. Asked again for every push."""
    if explicit:
        return explicit
    env = os.environ.get("GPUMEM_PUSH_URL", "")
    if env.strip():
        url = check_url(env, "GPUMEM_PUSH_URL", warn)
        if url:
            return url
    path = os.environ.get("GPUMEM_PUSH_SOCKET") or DEFAULT_SOCKET
    if os.path.exists(path):
        return "unix:" + path
    return DEFAULT_URL
