"""The agent's bounds on a push, copied (src/ingest/limits.rs and the agent's rate limit;
tests/it/ingest.rs checks every copy here against the agent's), and the rules for text and
labels that follow from them. A push built within them is never refused for its shape."""

import re
import unicodedata

# The names the agent exports as exported_<name>: the metric contract's labels, Prometheus's
# `le` and the target labels of Kubernetes service discovery (tests/it/ingest.rs checks this
# list against the agent's). Names it sets itself are accepted under that prefix.
COLLIDING = frozenset((
    "UUID", "GPU_I_ID", "GPU_I_PROFILE", "mig_uuid",
    "claim_name", "claim_namespace", "dra_device", "dra_driver", "dra_pool",
    "allocator", "config", "container_id", "container_name", "driver_version", "gpu",
    "kind", "model", "outcome", "pid", "pod_name", "pod_namespace", "pod_uid", "pool", "process",
    "reason", "result",
    "segment_size", "simulated", "source", "variable", "version", "le",
    "job", "instance", "namespace", "pod", "container", "node", "service", "endpoint",
    "cluster",
))
MAX_USER_LABELS = 8
MAX_LABEL_BYTES = 512  # names and values together, rank labels included
MAX_NAME = 64
MAX_TEXT = 128  # bytes of UTF-8, as the agent counts
MAX_DEVICES = 16
MAX_STATS_KEYS = 512
MAX_OOM_POOLS = 64  # (pool, stream, private) entries in an out-of-memory push
MAX_HOST_FIGURE = 1 << 53
# Byte figures (a key naming bytes) are below MAX_BYTES, others below MAX_COUNT (the
# agent's bound_of).
MAX_BYTES = 1 << 60
MAX_COUNT = 1 << 53
# Labels added under torchrun / torchelastic, from these variables where set.
RANK_LABELS = (("rank", "RANK"), ("local_rank", "LOCAL_RANK"), ("world_size", "WORLD_SIZE"),
               ("run_id", "TORCHELASTIC_RUN_ID"))
# host_memory_stats(): the figures sent, under PyTorch 2.10+'s names (#164412). From about 2.7
# to 2.9 the pool's blocks were `segment`/`reserved_bytes` and those in use
# `allocation`/`allocated_bytes`: those are renamed; every other key is dropped.
HOST_KEYS = ("allocated_bytes.current", "active_bytes.current", "allocations.current",
             "active_requests.current", "num_host_alloc", "num_host_free",
             "host_alloc_time.total")
OLD_HOST_KEYS = {"reserved_bytes.current": "allocated_bytes.current",
                 "allocated_bytes.current": "active_bytes.current",
                 "segment.current": "allocations.current",
                 "allocation.current": "active_requests.current"}
# The agent refuses a process's pushes less than 0.5 s apart (but for a few with a reason):
# the interval is at least this, and periodic pushes keep MIN_GAP from the previous push of
# any kind.
MIN_INTERVAL = 0.5
MIN_GAP = 0.55

_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


def is_visible_char(c):
    """A character the agent accepts in text: ASCII punctuation, symbols, letters and digits,
    the space, and letters and digits of any script (a subset of the agent's rule, so a
    text this accepts the agent accepts)."""
    return (" " <= c <= "~" or c.isalpha()
            or unicodedata.category(c) in ("Nd", "Nl", "No"))


def text_problem(value):
    """Why the agent would refuse this text (None if it would not): at most 128 bytes of
    UTF-8, of letters, digits, ASCII punctuation and spaces between them."""
    if len(value.encode("utf-8", "surrogatepass")) > MAX_TEXT:
        return f"longer than {MAX_TEXT} bytes"
    if not all(is_visible_char(c) for c in value):
        return "with characters other than letters, digits, ASCII punctuation and spaces"
    if value != value.strip(" "):
        return "with a space first or last"
    return None


def label_problem(name, value):
    """Why the agent would refuse this label (None if it would not)."""
    if not _NAME.match(name):
        return "is not a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*)"
    if name.startswith("__"):
        return "starts with __ (reserved by Prometheus)"
    if len(name) > MAX_NAME:
        return f"is longer than {MAX_NAME} characters"
    problem = text_problem(value)
    return f"has a value {problem}" if problem else None


def label_size(name, value):
    """The bytes a label counts against MAX_LABEL_BYTES."""
    return len(name.encode()) + len(value.encode("utf-8", "surrogatepass"))
