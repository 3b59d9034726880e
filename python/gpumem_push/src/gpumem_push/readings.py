"""What the pusher reads of PyTorch: never importing it, never initialising CUDA. Every
function here is a plain reading; the pusher's state (devices used, UUIDs) is not its
business."""

import inspect
import sys

from .limits import (HOST_KEYS, MAX_HOST_FIGURE, MAX_OOM_POOLS, MAX_STATS_KEYS, OLD_HOST_KEYS,
                     text_problem)


def imported(name):
    """Module `name` once the job has imported it completely, else None. Never imports."""
    module = sys.modules.get(name)
    if module is None:
        return None
    spec = getattr(module, "__spec__", None)
    if spec is not None and getattr(spec, "_initializing", False):
        return None  # the job's import is still running
    return module


def find_torch():
    """The job's torch module once it has imported it completely, else None. Never imports."""
    module = imported("torch")
    if module is None:
        return None
    cuda = module.__dict__.get("cuda")
    if cuda is None or not hasattr(cuda, "is_initialized"):
        return None  # not PyTorch (a namespace package called torch, say)
    return module


def memory_segments(torch):
    """The segments of the job's memory snapshot, without its allocation history where the
    job's PyTorch can leave it out (`include_traces=False`, 2.11 and later): with the history,
    a snapshot copies every recorded entry and its frames under the allocator's lock, and the
    summary reads none of them. An older `memory_snapshot` takes no such argument: it is
    called as it is."""
    snapshot = torch.cuda.memory_snapshot
    if takes_include_traces(snapshot):
        return snapshot(include_traces=False)
    return snapshot()


def periodic_segments(torch):
    """(segments, history) for a periodic reading: the segments as memory_segments reads
    them, and whether the snapshot showed an allocation history being recorded (known only
    where the job's PyTorch cannot leave it out: then `torch.cuda.memory._snapshot()`, which
    memory_snapshot() itself calls, gives the segments and tells whether it copied a
    history). A history recorded means the next periodic reading would copy it again."""
    full = getattr(getattr(torch.cuda, "memory", None), "_snapshot", None)
    if full is None or takes_include_traces(torch.cuda.memory_snapshot):
        return memory_segments(torch), False
    snapshot = full()
    traces = snapshot.get("device_traces") or ()
    return snapshot.get("segments", ()), any(traces)


def takes_include_traces(function):
    """Whether `function` names an `include_traces` parameter (a builtin whose signature
    cannot be read is taken not to)."""
    try:
        return "include_traces" in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def snapshot_summary(torch, request=None):
    """summarize() of the job's memory snapshot, read now."""
    return summarize(memory_segments(torch), request)


def summarize(segments, request=None):
    """{device index: {"largest": largest free block, "classes": {size class: [segments, free
    bytes]}, "pools": {(pool, stream, private): figures}}} from a memory snapshot's segments;
    a segment's class is the power of two at or above its size. With `request` (the
    observer's device, size, total and free, and the failing thread's stream), the pools'
    figures are added up too, and the failing device's entry gets the "oom" object the agent
    explains; without, "pools" stays empty (a periodic push sends none), and a segment's
    blocks are looked at only where its free bytes (`total_size - active_size`, where
    PyTorch gives them, expandable segments aside) could hold a block larger than the
    largest found so far."""
    summary = {}
    for segment in segments:
        get = segment.get
        device = int(get("device", 0))
        entry = summary.get(device)
        if entry is None:
            entry = summary[device] = {"largest": 0, "classes": {}, "pools": {}}
        total = int(get("total_size", 0))
        active = get("active_size")
        free = total - int(active) if active is not None else -1
        if request is None and 0 <= free <= entry["largest"] and not get("is_expandable"):
            # Its free bytes (all but the active ones, as PyTorch counts them) hold no block
            # larger than the largest found: its blocks need no look.
            largest = 0
        else:
            free, largest = free_blocks(get("blocks", ()))
        if total > 0:
            size_class = 1 << (total - 1).bit_length()
            count = entry["classes"].get(size_class)
            if count is None:
                entry["classes"][size_class] = [1, free]
            else:
                count[0] += 1
                count[1] += free
        if largest > entry["largest"]:
            entry["largest"] = largest
        if request is not None:
            add_pool_figures(entry["pools"], segment, get("blocks", ()), free)
    if request is not None:
        device, size, device_total, device_free, stream = request
        entry = summary.setdefault(device, {"largest": 0, "classes": {}, "pools": {}})
        reserved = sum(f["allocated"] + f["pending_free"] + f["free"]
                       for f in entry["pools"].values())
        # Figures that cannot add up (a device smaller than what is reserved on it) explain
        # nothing; the agent would refuse the whole push for them.
        if reserved <= device_total:
            entry["oom"] = {"size": size, "stream": stream, "device_total": device_total,
                            "device_free": device_free,
                            "pools": oom_pools(entry["pools"], stream)}
    return summary


def free_blocks(blocks):
    """(free bytes, the largest free block) of a segment's blocks."""
    free = largest = 0
    for b in blocks:
        if b.get("state") == "inactive":
            size = int(b.get("size", 0))
            free += size
            if size > largest:
                largest = size
    return free, largest


def add_pool_figures(pools, segment, blocks, free):
    """Adds a segment's blocks (`free` of their bytes free) to its (pool, stream, private)
    figures in `pools`."""
    pool = "small" if segment.get("segment_type") == "small" else "large"
    # A private pool's (CUDA graph, MemPool) free bytes serve only its own requests.
    private = tuple(segment.get("segment_pool_id") or (0, 0)) != (0, 0)
    figures = pools.setdefault(
        (pool, int(segment.get("stream", 0) or 0), private),
        {"allocated": 0, "requested": 0, "pending_free": 0, "free": 0, "largest_free": 0,
         "segments_with_free": 0})
    for b in blocks:
        size, state = int(b.get("size", 0)), b.get("state")
        if state == "active_allocated":
            figures["allocated"] += size
            figures["requested"] += min(size, int(b.get("requested_size", size)))
        elif state == "active_pending_free":
            figures["pending_free"] += size
        elif state == "inactive":
            figures["free"] += size
            figures["largest_free"] = max(figures["largest_free"], size)
    figures["segments_with_free"] += 1 if free > 0 else 0


def oom_pools(pools, stream):
    """The (pool, stream, private) figures as the agent takes them: the request's stream's
    default pools first, then the others by reserved bytes; past the agent's bound, the rest
    are added into the last kept entry of another stream that is as private as they are
    (memory the request could not use either way, counted where it belongs). A private
    pool's entry says so (only then: an agent from before private pools refuses the key)."""
    def reserved(item):
        f = item[1]
        return f["allocated"] + f["pending_free"] + f["free"]
    ordered = sorted(pools.items(),
                     key=lambda item: (item[0][1] != stream or item[0][2], -reserved(item)))

    def home(key, private):
        """Whether entry `key` can take the rest of kind `private`: as private, and another
        stream's (the request's own stream's default pools would count it as usable)."""
        return key[2] == private and (private or key[1] != stream)

    if len(ordered) <= MAX_OOM_POOLS:
        kept, rest = ordered, []
    else:
        # Two places are held back for a home of each kind the rest holds, if the entries
        # before lack one; the others go to the next entries in order.
        kept, rest = ordered[:MAX_OOM_POOLS - 2], ordered[MAX_OOM_POOLS - 2:]
        for private in (False, True):
            if (any(k[2] == private for k, _ in rest)
                    and not any(home(k, private) for k, _ in kept)):
                at = next(i for i, (k, _) in enumerate(rest) if home(k, private))
                kept.append(rest.pop(at))
        while len(kept) < MAX_OOM_POOLS:
            kept.append(rest.pop(0))
    out = [dict(f, pool=pool, stream=s, **({"private": True} if private else {}))
           for (pool, s, private), f in kept]
    for (_, _, private), f in rest:
        last = next(e for e in reversed(out)
                    if home((e["pool"], e["stream"], e.get("private", False)), private))
        for key in ("allocated", "requested", "pending_free", "free", "segments_with_free"):
            last[key] += f[key]
        last["largest_free"] = max(last["largest_free"], f["largest_free"])
    return out


def oom_request(torch, args):
    """(device, size, total, free, stream) of the failing allocation, from the observer's
    arguments (device, the size it tried to obtain, the device's total or the limit of a
    memory fraction, the device's free bytes) and the failing thread's current stream; None
    when the arguments are not four whole numbers."""
    if len(args) != 4 or not all(isinstance(a, int) and not isinstance(a, bool) and a >= 0
                                 for a in args):
        return None
    device, size, total, free = args
    try:
        stream = int(torch.cuda.current_stream(device).cuda_stream)
    except Exception:  # no current stream to ask for: the default stream's id
        stream = 0
    return device, size, total, free, max(stream, 0)


def is_used(stats):
    """Whether a device's memory_stats() show this process has used it."""
    return any(int(stats.get(key, 0) or 0) > 0
               for key in ("reserved_bytes.all.current", "reserved_bytes.all.peak", "num_ooms"))


# Statistics keys found acceptable: each is checked once, not at every push (PyTorch's keys
# are the same each time); at most this many are remembered.
_GOOD_KEYS = set()
MAX_GOOD_KEYS = 4 * MAX_STATS_KEYS


def good_key(key):
    """Whether the agent accepts `key` as a statistics key."""
    if key in _GOOD_KEYS:
        return True
    if not isinstance(key, str) or text_problem(key):
        return False
    if len(_GOOD_KEYS) < MAX_GOOD_KEYS:
        _GOOD_KEYS.add(key)
    return True


def clean_stats(stats):
    """Integer statistics the agent accepts (it refuses a whole push for one bad value)."""
    out = {}
    for key, value in stats.items():
        if len(out) >= MAX_STATS_KEYS:
            break
        if isinstance(value, bool) or not good_key(key):
            continue
        try:
            number = int(value)
        except (TypeError, ValueError, OverflowError):
            continue
        if number != value or (number < 0 and key != "max_split_size"):
            continue
        out[key] = number
    return out


def host(torch, error):
    """The pinned host memory to push, or None: where this torch has host_memory_stats() and
    the job has pinned memory (never initialising CUDA). A failure to read is reported to
    `error`."""
    cuda = torch.cuda
    read = getattr(cuda, "host_memory_stats", None)
    if read is None or not cuda.is_initialized():
        return None
    try:
        raw = read()
    except Exception as e:
        error(e)
        return None
    if not raw:
        return None
    old = "active_bytes.current" not in raw and "reserved_bytes.current" in raw
    out = {}
    for key, value in raw.items():
        name = OLD_HOST_KEYS.get(key, key) if old else key
        if name not in HOST_KEYS or isinstance(value, bool):
            continue
        try:
            number = int(value)
        except (TypeError, ValueError, OverflowError):
            continue
        if number == value and 0 <= number < MAX_HOST_FIGURE:
            out[name] = number
    if not out.get("num_host_alloc") and not out.get("allocated_bytes.current"):
        return None  # the job never pinned memory: no series for it
    # PyTorch reads these without one lock: a figure in use above its pool is a torn read,
    # which the agent would refuse with the whole push. It is left out of this one.
    for part, whole in (("active_bytes.current", "allocated_bytes.current"),
                        ("active_requests.current", "allocations.current")):
        if out.get(part, 0) > out.get(whole, out.get(part, 0)):
            del out[part]
    return out
