//! `SimDevice`: a deterministic simulated GPU.
//!
//! It models what the caching allocator can observe of a GPU and nothing more: a memory
//! capacity shared with other processes, an optional per-process limit, an address space that
//! hands out aligned addresses (and reuses freed ones, lowest first, as a driver does), streams
//! whose work completes only when the caller says so (or an explicit synchronisation waits for
//! it), and a virtual clock that charges each driver call what a GPU kind's table says it
//! costs ([`DriverCosts`]), including the device-wide synchronisation that `cudaMalloc` and
//! `cudaFree` imply. No host memory stands
//! behind simulated device memory.
//!
//! # Invariants
//! - `used_bytes` equals the sum of live segment sizes, and never exceeds the capacity left by
//!   other processes nor the per-process limit.
//! - Live segments occupy disjoint address ranges; free address ranges are disjoint, merged
//!   with their neighbours, and never overlap a live segment.
//! - An event is complete exactly when its stream's completed-work mark has reached the mark
//!   taken when it was recorded; nothing completes by itself.
//! - Every stream whose completed-work mark moved since the allocator last asked
//!   (`take_completed_streams`) is listed, unless every stream's may have (then the answer is
//!   "any").
//! - Virtual memory: reservations take address space but no memory; physical pages count
//!   against memory from creation to release; a mapping lies inside one reservation, covers
//!   exactly one page handle, and never overlaps another mapping. A page may be mapped at
//!   several addresses at once (as `cuMemMap` allows); it is released only once unmapped
//!   everywhere, a reservation freed only without mappings.
//!
//! # Budgets
//! - Host memory: a constant number of bytes per page, mapping, reservation, segment, stream
//!   and event it knows of; [`Device::host_bytes`] estimates them in constant time (from
//!   the maps' lengths and capacities), so that a replay's memory budget counts a device
//!   asked to map millions of pages.

use std::collections::BTreeMap;
use std::sync::Arc;

use rustc_hash::FxHashMap;

use super::costs::{Call, DriverCosts};
use super::{Device, DeviceError, DevicePtr, EventId, MemInfo, PhysicalHandle, StreamId};

/// Configuration of a [`SimDevice`].
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Device index reported to the allocator.
    pub index: u32,
    /// Total device memory in bytes.
    pub capacity: u64,
    /// Bytes held by other processes (and the CUDA context): they reduce free memory.
    pub other_process_bytes: u64,
    /// A per-process cap on memory this process may hold, as MIG or a container limit imposes.
    pub process_limit: Option<u64>,
    /// Alignment of segment addresses.
    pub alignment: u64,
    /// First address of the simulated address space.
    pub base_address: u64,
    /// Size of the simulated address space.
    pub address_space: u64,
    /// Clock reading (µs since the Unix epoch) at creation.
    pub start_time_us: u64,
    /// What each driver call costs the clock.
    pub costs: Arc<DriverCosts>,
    /// Whether the virtual-memory API (expandable segments) is offered.
    pub virtual_memory: bool,
    /// Granularity of physical pages and mappings.
    pub page_granularity: u64,
    /// Whether the device names the streams whose work completed
    /// ([`Device::take_completed_streams`]); off, it answers as a real GPU does ("any").
    pub names_completed_streams: bool,
}

impl Default for SimConfig {
    /// An 80 GiB GPU, its calls priced by [`DriverCosts::default`] (an H200's, measured).
    fn default() -> Self {
        SimConfig {
            index: 0,
            capacity: 80 << 30,
            other_process_bytes: 0,
            process_limit: None,
            alignment: 2 << 20,
            base_address: 0x7f00_0000_0000,
            address_space: 1 << 44,
            start_time_us: 1_700_000_000_000_000,
            costs: Arc::new(DriverCosts::default()),
            virtual_memory: true,
            page_granularity: 2 << 20,
            names_completed_streams: true,
        }
    }
}

impl SimConfig {
    /// A device of `capacity` bytes, other settings default.
    pub fn with_capacity(capacity: u64) -> Self {
        SimConfig {
            capacity,
            ..SimConfig::default()
        }
    }
}

/// Counters of the driver calls a [`SimDevice`] has answered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    /// `malloc` calls, failed ones included.
    pub malloc_calls: u64,
    /// Physical pages created, failed attempts included.
    pub page_creates: u64,
    /// Pages mapped.
    pub maps: u64,
    /// Pages unmapped.
    pub unmaps: u64,
    /// Physical pages released.
    pub releases: u64,
    /// Address ranges reserved or freed.
    pub address_calls: u64,
    /// Synchronisations asked for: of the device, a stream or an event.
    pub synchronize_calls: u64,
    /// `free` calls.
    pub free_calls: u64,
    /// Events created.
    pub events_created: u64,
    /// Event queries answered (those an allocator left out, knowing from
    /// [`Device::take_completed_streams`] that they would find nothing, are charged to the
    /// clock but not counted here).
    pub event_queries: u64,
    /// Device-wide synchronisations (explicit or implied by malloc/free).
    pub synchronizations: u64,
    /// Simulated time spent in driver calls, in nanoseconds.
    pub driver_time_ns: u64,
    /// Bytes this process holds now.
    pub used_bytes: u64,
    /// Most bytes this process has held at once.
    pub peak_used_bytes: u64,
}

impl SimStats {
    /// The calls the driver received to obtain, map or give back memory, one per CUDA call:
    /// `cudaMalloc`, `cudaFree`, `cuMemCreate`, `cuMemMap` and `cuMemSetAccess` (two per
    /// map), `cuMemUnmap`, `cuMemRelease`, address reservations and their frees, and the
    /// synchronisations asked for. Event calls are left out: the caching allocator and a
    /// plan alike make them per free on another stream.
    pub fn driver_calls(&self) -> u64 {
        self.malloc_calls
            + self.free_calls
            + self.page_creates
            + 2 * self.maps
            + self.unmaps
            + self.releases
            + self.address_calls
            + self.synchronize_calls
    }
}

#[derive(Clone, Debug, Default)]
struct SimStream {
    /// Work items submitted so far (each recorded event is one).
    submitted: u64,
    /// Work items completed so far.
    completed: u64,
}

#[derive(Clone, Copy, Debug)]
struct SimEvent {
    /// The stream and work mark the event was last recorded at; `None` if never recorded
    /// (a never-recorded event counts as complete, as in CUDA).
    recorded: Option<(StreamId, u64)>,
}

/// An allocation failure to inject.
#[derive(Clone, Debug)]
struct Fault {
    /// The allocation call (malloc or page creation; 1-based, counted over the device's life)
    /// that fails.
    call: u64,
    error: DeviceError,
}

/// A deterministic simulated GPU. See the module documentation.
#[derive(Debug, Clone)]
pub struct SimDevice {
    config: SimConfig,
    /// Free address ranges: start → length.
    free_ranges: BTreeMap<u64, u64>,
    /// Live segments: address → size.
    segments: FxHashMap<u64, u64>,
    streams: FxHashMap<StreamId, SimStream>,
    events: FxHashMap<EventId, SimEvent>,
    next_event: u64,
    faults: Vec<Fault>,
    fail_above: Option<u64>,
    /// While set, every allocation fails with out-of-memory.
    fail_all: bool,
    /// Addresses the next placements must take, in order (replaying a recording).
    address_hints: std::collections::VecDeque<u64>,
    /// Allocation calls so far (malloc and physical page creation), for fault injection.
    allocation_calls: u64,
    /// Address reservations: start → size.
    reservations: BTreeMap<u64, u64>,
    /// Physical pages: handle → (size, the addresses it is mapped at, whether it was ever
    /// mapped: its first map is priced with its creation).
    pages: FxHashMap<PhysicalHandle, (u64, u32, bool)>,
    next_page: u64,
    /// Mappings: start → (size, handle).
    mappings: BTreeMap<u64, (u64, PhysicalHandle)>,
    /// Streams being captured into a graph.
    capturing: Vec<StreamId>,
    /// Streams whose work completed since [`Device::take_completed_streams`] last asked;
    /// `None` once every stream's may have (or the list grew longer than `streams`).
    completed_since: Option<Vec<StreamId>>,
    stats: SimStats,
}

impl SimDevice {
    /// A simulated GPU with the given configuration.
    pub fn new(config: SimConfig) -> Self {
        let mut free_ranges = BTreeMap::new();
        free_ranges.insert(config.base_address, config.address_space);
        SimDevice {
            config,
            free_ranges,
            segments: FxHashMap::default(),
            streams: FxHashMap::default(),
            events: FxHashMap::default(),
            next_event: 1,
            faults: Vec::new(),
            fail_above: None,
            fail_all: false,
            address_hints: std::collections::VecDeque::new(),
            allocation_calls: 0,
            reservations: BTreeMap::new(),
            pages: FxHashMap::default(),
            next_page: 1,
            mappings: BTreeMap::new(),
            capturing: Vec::new(),
            completed_since: Some(Vec::new()),
            stats: SimStats::default(),
        }
    }

    /// A simulated GPU of `capacity` bytes.
    pub fn with_capacity(capacity: u64) -> Self {
        SimDevice::new(SimConfig::with_capacity(capacity))
    }

    /// The configuration the device was built with.
    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    /// Driver-call counters and simulated driver time.
    pub fn stats(&self) -> SimStats {
        self.stats
    }

    /// Sets the bytes held by other processes (they reduce free memory from now on).
    pub fn set_other_process_bytes(&mut self, bytes: u64) {
        self.config.other_process_bytes = bytes;
    }

    /// Makes the `n`-th allocation call from now (1 = the next one; `malloc` and physical
    /// page creation both count) fail with `error`.
    pub fn fail_allocation_in(&mut self, n: u64, error: DeviceError) {
        let call = self.allocation_calls + n.max(1);
        self.faults.push(Fault { call, error });
    }

    /// Makes every allocation (`malloc` or page creation) larger than `size` bytes fail with
    /// out-of-memory (`None` clears it).
    pub fn fail_allocation_above(&mut self, size: Option<u64>) {
        self.fail_above = size;
    }

    /// Makes every allocation fail with out-of-memory until cleared, as a recording that
    /// shows an OOM demands.
    pub fn fail_all_allocations(&mut self, fail: bool) {
        self.fail_all = fail;
    }

    /// Makes the next placements (segments or reservations) take these addresses, in order.
    /// A placement whose hinted range is not free fails with out-of-memory.
    pub fn hint_addresses(&mut self, addresses: impl IntoIterator<Item = u64>) {
        self.address_hints.extend(addresses);
    }

    /// Forgets unused address hints.
    pub fn clear_address_hints(&mut self) {
        self.address_hints.clear();
    }

    /// Number of live address reservations.
    pub fn reservation_count(&self) -> usize {
        self.reservations.len()
    }

    /// Whether `addr` lies in a live address reservation.
    pub fn is_reserved(&self, addr: u64) -> bool {
        self.reservation_at(addr).is_some()
    }

    /// The live address reservation holding `addr`: (start, size).
    pub fn reservation_at(&self, addr: u64) -> Option<(u64, u64)> {
        self.reservations
            .range(..=addr)
            .next_back()
            .filter(|&(&start, &len)| addr < start + len)
            .map(|(&start, &len)| (start, len))
    }

    /// Bytes of address space reserved (and not yet freed).
    pub fn reserved_address_space(&self) -> u64 {
        self.reservations.values().sum()
    }

    /// Bytes of physical pages currently mapped.
    pub fn mapped_bytes(&self) -> u64 {
        self.mappings.values().map(|&(size, _)| size).sum()
    }

    /// Whether the whole range `[ptr, ptr + size)` is covered by mappings.
    pub fn is_mapped(&self, ptr: u64, size: u64) -> bool {
        let end = ptr + size;
        let mut at = ptr;
        while at < end {
            match self.mappings.range(..=at).next_back() {
                Some((&start, &(len, _))) if start + len > at => at = start + len,
                _ => return false,
            }
        }
        true
    }

    /// Checks a new allocation of `size` bytes against injected faults and free memory.
    fn admit_allocation(&mut self, size: u64) -> Result<(), DeviceError> {
        self.allocation_calls += 1;
        let call = self.allocation_calls;
        if let Some(i) = self.faults.iter().position(|f| f.call == call) {
            return Err(self.faults.swap_remove(i).error);
        }
        if size == 0
            || self.fail_all
            || self.fail_above.is_some_and(|limit| size > limit)
            || size > self.available()
        {
            return Err(DeviceError::OutOfMemory);
        }
        Ok(())
    }

    fn use_bytes(&mut self, size: u64) {
        self.stats.used_bytes += size;
        self.stats.peak_used_bytes = self.stats.peak_used_bytes.max(self.stats.used_bytes);
    }

    fn reservation_containing(&self, ptr: u64, size: u64) -> Option<u64> {
        let (&start, &len) = self.reservations.range(..=ptr).next_back()?;
        (ptr + size <= start + len).then_some(start)
    }

    /// Starts (`true`) or ends a graph capture of `stream` (`cudaStreamBeginCapture`,
    /// `cudaStreamEndCapture`), as [`Device::is_capturing`] reports it.
    pub fn set_capturing(&mut self, stream: StreamId, capturing: bool) {
        self.capturing.retain(|&s| s != stream);
        if capturing {
            self.capturing.push(stream);
        }
    }

    /// Completes all work queued so far on `stream`: events recorded on it complete.
    pub fn complete_stream(&mut self, stream: StreamId) {
        self.complete_stream_to(stream, u64::MAX);
    }

    /// Completes the work queued on `stream` up to `mark` (all of it at most).
    fn complete_stream_to(&mut self, stream: StreamId, mark: u64) {
        let Some(s) = self.streams.get_mut(&stream) else {
            return;
        };
        let completed = s.submitted.min(mark.max(s.completed));
        if completed != s.completed {
            s.completed = completed;
            if let Some(streams) = &mut self.completed_since {
                streams.push(stream);
                // Longer than the streams it could name, the list says no more than "any":
                // so it stays bounded however long nobody asks.
                if streams.len() > self.streams.len() {
                    self.completed_since = None;
                }
            }
        }
    }

    /// Completes all work queued so far on every stream.
    pub fn complete_all_streams(&mut self) {
        for s in self.streams.values_mut() {
            s.completed = s.submitted;
        }
        self.completed_since = None;
    }

    /// Number of live segments.
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// Number of events created and not destroyed.
    pub fn event_count(&self) -> usize {
        self.events.len()
    }

    fn is_recorded_complete(&self, event: &SimEvent) -> bool {
        match event.recorded {
            None => true,
            Some((stream, mark)) => self
                .streams
                .get(&stream)
                .is_some_and(|s| s.completed >= mark),
        }
    }

    /// Charges the clock one `call` of `size` bytes.
    fn charge(&mut self, call: Call, size: u64) {
        let ns = self.config.costs.ns(call, size);
        self.stats.driver_time_ns = self.stats.driver_time_ns.saturating_add(ns);
    }

    /// Charges `call` and the device-wide synchronisation it implies (`cudaMalloc`,
    /// `cudaFree`), unless the table's figure for it includes it. Queued work is not
    /// completed by it: when work completes stays the caller's decision, so that tests and
    /// replays control exactly when deferred frees become reusable.
    fn charge_synchronizing(&mut self, call: Call, size: u64) {
        self.stats.synchronizations += 1;
        self.charge(call, size);
        if !self.config.costs.includes_synchronize(call) {
            self.charge(Call::Synchronize, 0);
        }
    }

    /// Bytes this process may still obtain: the smaller of what the device has left and what
    /// the per-process limit allows.
    fn available(&self) -> u64 {
        let device_free = self
            .config
            .capacity
            .saturating_sub(self.config.other_process_bytes)
            .saturating_sub(self.stats.used_bytes);
        match self.config.process_limit {
            Some(limit) => device_free.min(limit.saturating_sub(self.stats.used_bytes)),
            None => device_free,
        }
    }

    /// First-fit placement of `size` bytes at an aligned address. A hinted address must be a
    /// multiple of `hint_alignment` (a driver never hands out less aligned ones, and the
    /// allocator relies on it): a recording that says otherwise gets out-of-memory, not a
    /// misaligned segment.
    fn take_address_range(&mut self, size: u64, hint_alignment: u64) -> Option<u64> {
        if let Some(addr) = self.address_hints.pop_front() {
            let aligned = addr.is_multiple_of(hint_alignment.max(1));
            return (aligned && self.carve_address_range(addr, size)).then_some(addr);
        }
        let align = self.config.alignment.max(1);
        let (start, len, addr) = self.free_ranges.iter().find_map(|(&start, &len)| {
            let addr = start.checked_next_multiple_of(align)?;
            let end = addr.checked_add(size)?;
            (end <= start + len).then_some((start, len, addr))
        })?;
        self.free_ranges.remove(&start);
        if addr > start {
            self.free_ranges.insert(start, addr - start);
        }
        let end = addr + size;
        if end < start + len {
            self.free_ranges.insert(end, start + len - end);
        }
        Some(addr)
    }

    /// Takes exactly `[addr, addr + size)` out of the free address space, if it is free.
    fn carve_address_range(&mut self, addr: u64, size: u64) -> bool {
        let Some(end) = addr.checked_add(size) else {
            return false;
        };
        let Some((&start, &len)) = self.free_ranges.range(..=addr).next_back() else {
            return false;
        };
        if end > start + len {
            return false;
        }
        self.free_ranges.remove(&start);
        if addr > start {
            self.free_ranges.insert(start, addr - start);
        }
        if end < start + len {
            self.free_ranges.insert(end, start + len - end);
        }
        true
    }

    fn return_address_range(&mut self, addr: u64, size: u64) {
        let (mut start, mut len) = (addr, size);
        if let Some((&prev, &prev_len)) = self.free_ranges.range(..addr).next_back()
            && prev + prev_len == addr
        {
            self.free_ranges.remove(&prev);
            start = prev;
            len += prev_len;
        }
        if let Some(next_len) = self.free_ranges.remove(&(addr + size)) {
            len += next_len;
        }
        self.free_ranges.insert(start, len);
    }

    fn event_mut(&mut self, event: EventId) -> Result<&mut SimEvent, DeviceError> {
        self.events
            .get_mut(&event)
            .ok_or_else(|| DeviceError::InvalidArgument(format!("unknown event {}", event.0)))
    }
}

impl Device for SimDevice {
    fn index(&self) -> u32 {
        self.config.index
    }

    fn malloc(&mut self, size: u64) -> Result<DevicePtr, DeviceError> {
        self.stats.malloc_calls += 1;
        self.charge_synchronizing(Call::Malloc, size);
        self.admit_allocation(size)?;
        // cudaMalloc's addresses are at least 512-byte aligned (gpumem's block granularity).
        let addr = self
            .take_address_range(size, 512)
            .ok_or(DeviceError::OutOfMemory)?;
        self.segments.insert(addr, size);
        self.use_bytes(size);
        Ok(DevicePtr(addr))
    }

    fn free(&mut self, ptr: DevicePtr) -> Result<(), DeviceError> {
        self.stats.free_calls += 1;
        let size = self.segments.remove(&ptr.0);
        self.charge_synchronizing(Call::Free, size.unwrap_or(0));
        let size =
            size.ok_or_else(|| DeviceError::InvalidArgument(format!("free of unknown {ptr:?}")))?;
        self.stats.used_bytes -= size;
        self.return_address_range(ptr.0, size);
        Ok(())
    }

    fn mem_get_info(&mut self) -> Result<MemInfo, DeviceError> {
        self.charge(Call::MemGetInfo, 0);
        let used = self.config.other_process_bytes + self.stats.used_bytes;
        Ok(MemInfo {
            free: self.config.capacity.saturating_sub(used),
            total: self.config.capacity,
        })
    }

    fn create_event(&mut self) -> Result<EventId, DeviceError> {
        self.stats.events_created += 1;
        self.charge(Call::Event, 0);
        let id = EventId(self.next_event);
        self.next_event += 1;
        self.events.insert(id, SimEvent { recorded: None });
        Ok(id)
    }

    fn record_event(&mut self, event: EventId, stream: StreamId) -> Result<(), DeviceError> {
        self.charge(Call::Event, 0);
        let s = self.streams.entry(stream).or_default();
        s.submitted += 1;
        let mark = s.submitted;
        self.event_mut(event)?.recorded = Some((stream, mark));
        Ok(())
    }

    fn query_event(&mut self, event: EventId) -> Result<bool, DeviceError> {
        self.stats.event_queries += 1;
        self.charge(Call::Event, 0);
        let e = *self.event_mut(event)?;
        Ok(self.is_recorded_complete(&e))
    }

    fn synchronize_event(&mut self, event: EventId) -> Result<(), DeviceError> {
        self.stats.synchronize_calls += 1;
        self.charge(Call::Event, 0);
        if let Some((stream, mark)) = self.event_mut(event)?.recorded {
            // Waiting for the event means the stream's work up to it has run.
            self.complete_stream_to(stream, mark);
        }
        Ok(())
    }

    fn destroy_event(&mut self, event: EventId) -> Result<(), DeviceError> {
        self.events
            .remove(&event)
            .map(|_| ())
            .ok_or_else(|| DeviceError::InvalidArgument(format!("unknown event {}", event.0)))
    }

    fn synchronize(&mut self) -> Result<(), DeviceError> {
        self.stats.synchronizations += 1;
        self.stats.synchronize_calls += 1;
        self.charge(Call::Synchronize, 0);
        self.complete_all_streams();
        Ok(())
    }

    fn synchronize_stream(&mut self, stream: StreamId) -> Result<(), DeviceError> {
        self.stats.synchronize_calls += 1;
        self.charge(Call::Synchronize, 0);
        self.complete_stream(stream);
        Ok(())
    }

    fn time_us(&self) -> u64 {
        self.config.start_time_us + self.stats.driver_time_ns / 1000
    }

    fn is_capturing(&mut self, stream: StreamId) -> Result<bool, DeviceError> {
        Ok(self.capturing.contains(&stream))
    }

    fn take_completed_streams(&mut self) -> Option<Vec<StreamId>> {
        let named = self.completed_since.replace(Vec::new());
        named.filter(|_| self.config.names_completed_streams)
    }

    fn skip_event_queries(&mut self, n: usize) {
        let ns = self
            .config
            .costs
            .ns(Call::Event, 0)
            .saturating_mul(n as u64);
        self.stats.driver_time_ns = self.stats.driver_time_ns.saturating_add(ns);
    }

    fn supports_virtual_memory(&self) -> bool {
        self.config.virtual_memory
    }

    fn page_granularity(&self) -> Result<u64, DeviceError> {
        if !self.config.virtual_memory {
            return Err(DeviceError::Unsupported("virtual memory management"));
        }
        Ok(self.config.page_granularity)
    }

    fn reserve_address_range(&mut self, size: u64) -> Result<DevicePtr, DeviceError> {
        let granularity = self.page_granularity()?;
        if size == 0 || !size.is_multiple_of(granularity) {
            return Err(DeviceError::InvalidArgument(format!(
                "reservation of {size} bytes is not a multiple of the {granularity}-byte granularity"
            )));
        }
        self.stats.address_calls += 1;
        let addr = self
            .take_address_range(size, granularity)
            .ok_or(DeviceError::OutOfMemory)?;
        self.reservations.insert(addr, size);
        Ok(DevicePtr(addr))
    }

    fn free_address_range(&mut self, ptr: DevicePtr, size: u64) -> Result<(), DeviceError> {
        self.stats.address_calls += 1;
        if self.reservations.get(&ptr.0) != Some(&size) {
            return Err(DeviceError::InvalidArgument(format!(
                "no reservation of {size} bytes at {ptr:?}"
            )));
        }
        if self.mappings.range(ptr.0..ptr.0 + size).next().is_some() {
            return Err(DeviceError::InvalidArgument(format!(
                "reservation at {ptr:?} still has mappings"
            )));
        }
        self.reservations.remove(&ptr.0);
        self.return_address_range(ptr.0, size);
        Ok(())
    }

    fn create_physical_page(&mut self, size: u64) -> Result<PhysicalHandle, DeviceError> {
        let granularity = self.page_granularity()?;
        self.stats.page_creates += 1;
        self.charge(Call::PageIn, size);
        if !size.is_multiple_of(granularity) {
            return Err(DeviceError::InvalidArgument(format!(
                "page of {size} bytes is not a multiple of the {granularity}-byte granularity"
            )));
        }
        self.admit_allocation(size)?;
        let handle = PhysicalHandle(self.next_page);
        self.next_page += 1;
        self.pages.insert(handle, (size, 0, false));
        self.use_bytes(size);
        Ok(handle)
    }

    fn release_physical_page(&mut self, handle: PhysicalHandle) -> Result<(), DeviceError> {
        self.stats.releases += 1;
        match self.pages.get(&handle) {
            Some(&(size, 0, _)) => {
                self.charge(Call::Release, size);
                self.pages.remove(&handle);
                self.stats.used_bytes -= size;
                Ok(())
            }
            Some(&(_, at, _)) => Err(DeviceError::InvalidArgument(format!(
                "page {} is still mapped at {at} addresses",
                handle.0
            ))),
            None => Err(DeviceError::InvalidArgument(format!(
                "unknown page {}",
                handle.0
            ))),
        }
    }

    fn map(
        &mut self,
        ptr: DevicePtr,
        size: u64,
        handle: PhysicalHandle,
    ) -> Result<(), DeviceError> {
        self.stats.maps += 1;
        let Some(&(page_size, mappings, mapped_before)) = self.pages.get(&handle) else {
            return Err(DeviceError::InvalidArgument(format!(
                "unknown page {}",
                handle.0
            )));
        };
        if page_size != size {
            return Err(DeviceError::InvalidArgument(format!(
                "page {} ({page_size} bytes) cannot be mapped as {size} bytes at {ptr:?}",
                handle.0
            )));
        }
        if self.reservation_containing(ptr.0, size).is_none() {
            return Err(DeviceError::InvalidArgument(format!(
                "{ptr:?}+{size} is outside every reservation"
            )));
        }
        let overlaps = self
            .mappings
            .range(..ptr.0 + size)
            .next_back()
            .is_some_and(|(&start, &(len, _))| start + len > ptr.0);
        if overlaps {
            return Err(DeviceError::InvalidArgument(format!(
                "{ptr:?} is already mapped"
            )));
        }
        if mapped_before {
            self.charge(Call::Remap, size);
        }
        self.mappings.insert(ptr.0, (size, handle));
        self.pages.insert(handle, (size, mappings + 1, true));
        Ok(())
    }

    fn unmap(&mut self, ptr: DevicePtr, size: u64) -> Result<(), DeviceError> {
        self.stats.unmaps += 1;
        self.charge(Call::Unmap, size);
        match self.mappings.get(&ptr.0) {
            Some(&(len, handle)) if len == size => {
                self.mappings.remove(&ptr.0);
                if let Some(page) = self.pages.get_mut(&handle) {
                    page.1 -= 1;
                }
                Ok(())
            }
            _ => Err(DeviceError::InvalidArgument(format!(
                "no mapping of {size} bytes at {ptr:?}"
            ))),
        }
    }

    fn host_bytes(&self) -> usize {
        use std::mem::size_of;
        // Hash tables: an entry and a control byte per bucket; B-trees: an entry twice over
        // (nodes are half full at worst).
        fn table<T>(capacity: usize) -> usize {
            capacity * (size_of::<T>() + 1)
        }
        fn tree<T>(len: usize) -> usize {
            len * 2 * size_of::<T>()
        }
        table::<(PhysicalHandle, (u64, u32, bool))>(self.pages.capacity())
            + tree::<(u64, (u64, PhysicalHandle))>(self.mappings.len())
            + tree::<(u64, u64)>(self.reservations.len() + self.free_ranges.len())
            + table::<(u64, u64)>(self.segments.capacity())
            + table::<(StreamId, SimStream)>(self.streams.capacity())
            + table::<(EventId, SimEvent)>(self.events.capacity())
            + self.address_hints.capacity() * size_of::<u64>()
            + self.faults.capacity() * size_of::<Fault>()
            + (self.capturing.capacity() + self.completed_since.as_ref().map_or(0, Vec::capacity))
                * size_of::<StreamId>()
    }
}

/// The UUID of simulated GPU `index`, in the `GPU-…` form NVML and DCGM use: what the demo's
/// node and gpumem-torch's simulated devices report.
pub fn simulated_uuid(index: u32) -> String {
    format!("GPU-5e1a7ed0-0000-4000-8000-{index:012x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_aligned_reused_and_capacity_is_enforced() {
        let mut d = SimDevice::with_capacity(10 << 20);
        let a = d.malloc(3 << 20).expect("fits");
        let b = d.malloc(2 << 20).expect("fits");
        assert_eq!(a.0 % (2 << 20), 0);
        assert_eq!(
            b.0,
            a.0 + (4 << 20),
            "next aligned address after a 3 MiB segment"
        );
        assert_eq!(d.malloc(6 << 20), Err(DeviceError::OutOfMemory));
        d.free(a).expect("live");
        let c = d.malloc(1 << 20).expect("fits");
        assert_eq!(c, a, "the lowest freed range is reused first");
        assert_eq!(d.stats().used_bytes, 3 << 20);
        assert!(d.free(DevicePtr(12345)).is_err());
    }

    #[test]
    fn freed_ranges_merge_back_into_one() {
        let mut d = SimDevice::with_capacity(1 << 30);
        let ptrs: Vec<_> = (0..4).map(|_| d.malloc(2 << 20).expect("fits")).collect();
        for p in [ptrs[1], ptrs[3], ptrs[0], ptrs[2]] {
            d.free(p).expect("live");
        }
        assert_eq!(d.free_ranges.len(), 1);
        assert_eq!(
            d.free_ranges.get(&d.config.base_address),
            Some(&d.config.address_space)
        );
    }

    #[test]
    fn limits_and_faults() {
        let mut d = SimDevice::new(SimConfig {
            process_limit: Some(8 << 20),
            other_process_bytes: 1 << 20,
            ..SimConfig::with_capacity(16 << 20)
        });
        assert_eq!(
            d.malloc(10 << 20),
            Err(DeviceError::OutOfMemory),
            "over the process limit"
        );
        assert_eq!(
            d.mem_get_info().expect("info"),
            MemInfo {
                free: 15 << 20,
                total: 16 << 20
            }
        );
        d.fail_allocation_in(2, DeviceError::Driver("boom".into()));
        assert!(d.malloc(2 << 20).is_ok());
        assert_eq!(d.malloc(2 << 20), Err(DeviceError::Driver("boom".into())));
        assert!(d.malloc(2 << 20).is_ok());
        d.fail_allocation_above(Some(1 << 20));
        assert_eq!(d.malloc(2 << 20), Err(DeviceError::OutOfMemory));
    }

    #[test]
    fn virtual_memory_accounts_pages_not_address_space() {
        let page = 2 << 20;
        let mut d = SimDevice::with_capacity(8 << 20);
        let va = d
            .reserve_address_range(64 << 20)
            .expect("address space is not memory");
        assert_eq!(d.stats().used_bytes, 0);
        let pages: Vec<_> = (0..4)
            .map(|_| d.create_physical_page(page).expect("fits"))
            .collect();
        assert_eq!(d.create_physical_page(page), Err(DeviceError::OutOfMemory));
        assert_eq!(d.stats().used_bytes, 8 << 20);
        d.map(va, page, pages[0]).expect("maps");
        d.map(DevicePtr(va.0 + page), page, pages[1]).expect("maps");
        assert!(d.map(va, page, pages[2]).is_err(), "overlapping mapping");
        assert!(
            d.map(DevicePtr(va.0 + (64 << 20)), page, pages[2]).is_err(),
            "outside"
        );
        // A page mapped at two addresses stays until unmapped at both.
        d.map(DevicePtr(va.0 + 3 * page), page, pages[1])
            .expect("a second mapping of one page");
        assert_eq!(d.stats().used_bytes, 8 << 20, "counted once");
        d.unmap(DevicePtr(va.0 + 3 * page), page).expect("mapped");
        assert!(d.is_mapped(va.0, 2 * page));
        assert!(!d.is_mapped(va.0, 3 * page));
        assert!(d.release_physical_page(pages[0]).is_err(), "still mapped");
        assert!(
            d.free_address_range(va, 64 << 20).is_err(),
            "still has mappings"
        );
        d.unmap(va, page).expect("mapped");
        d.unmap(DevicePtr(va.0 + page), page).expect("mapped");
        for p in pages {
            d.release_physical_page(p).expect("unmapped");
        }
        assert_eq!(d.stats().used_bytes, 0);
        d.free_address_range(va, 64 << 20)
            .expect("empty reservation");
        assert_eq!(d.reservation_count(), 0);
        let mut plain = SimDevice::new(SimConfig {
            virtual_memory: false,
            ..SimConfig::default()
        });
        assert!(plain.reserve_address_range(page).is_err());
    }

    #[test]
    fn events_complete_only_when_told() {
        let mut d = SimDevice::with_capacity(1 << 30);
        let (s1, s2) = (StreamId(7), StreamId(8));
        let e1 = d.create_event().expect("event");
        let e2 = d.create_event().expect("event");
        let e3 = d.create_event().expect("event");
        d.record_event(e1, s1).expect("record");
        d.record_event(e2, s1).expect("record");
        d.record_event(e3, s2).expect("record");
        assert!(!d.query_event(e1).expect("query"));
        assert_eq!(d.take_completed_streams(), Some(vec![]));
        d.synchronize_event(e1).expect("sync");
        assert!(d.query_event(e1).expect("query"));
        assert!(
            !d.query_event(e2).expect("query"),
            "later work is still pending"
        );
        assert_eq!(d.take_completed_streams(), Some(vec![s1]));
        d.complete_stream(s1);
        d.complete_stream(s1);
        d.complete_stream(StreamId(9));
        d.complete_stream(s2);
        assert!(d.query_event(e2).expect("query"));
        // Each stream whose work advanced is named once per advance; a stream with nothing
        // queued never is.
        assert_eq!(d.take_completed_streams(), Some(vec![s1, s2]));
        assert_eq!(d.take_completed_streams(), Some(vec![]));
        // Advances past the number of streams, nobody asking: "any", not a growing list.
        for _ in 0..3 {
            d.record_event(e1, s1).expect("record");
            d.complete_stream(s1);
        }
        assert_eq!(d.take_completed_streams(), None);
        // After a device-wide wait, any stream may have progressed.
        d.synchronize().expect("sync");
        assert_eq!(d.take_completed_streams(), None);
        assert_eq!(d.take_completed_streams(), Some(vec![]));
        let before = d.stats().driver_time_ns;
        d.malloc(2 << 20).expect("fits");
        assert!(
            d.stats().driver_time_ns > before,
            "driver calls advance the clock"
        );
    }

    #[test]
    fn the_clock_charges_each_call_from_the_table_and_counts_calls_as_cuda_gets_them() {
        let mut costs = DriverCosts::public();
        let mut price = |call, points: Vec<(u64, u64)>, includes_synchronize| {
            costs.calls.insert(
                call,
                crate::device::CallCost {
                    points,
                    includes_synchronize,
                    source: crate::device::Source::Public("test".into()),
                },
            );
        };
        price(
            Call::Malloc,
            vec![(2 << 20, 1_000), (4 << 20, 3_000)],
            false,
        );
        price(Call::Free, vec![(0, 500)], true);
        price(Call::Synchronize, vec![(0, 7)], false);
        price(Call::PageIn, vec![(2 << 20, 100), (4 << 20, 300)], false);
        price(Call::Remap, vec![(0, 40)], false);
        price(Call::Unmap, vec![(0, 20)], false);
        price(Call::Release, vec![(0, 10)], false);
        let mut d = SimDevice::new(SimConfig {
            costs: Arc::new(costs),
            ..SimConfig::with_capacity(1 << 30)
        });
        let clock = |d: &SimDevice| d.stats().driver_time_ns;
        let p = d.malloc(3 << 20).expect("fits");
        assert_eq!(
            clock(&d),
            2_000 + 7,
            "by size, and the implied synchronisation"
        );
        d.free(p).expect("live");
        assert_eq!(clock(&d), 2_007 + 500, "a figure that includes it");
        let va = d.reserve_address_range(8 << 20).expect("reserve");
        let h = d.create_physical_page(4 << 20).expect("page");
        d.map(va, 4 << 20, h).expect("map");
        assert_eq!(
            clock(&d),
            2_507 + 300,
            "a page in: created, mapped, accessed"
        );
        d.map(DevicePtr(va.0 + (4 << 20)), 4 << 20, h)
            .expect("a second mapping");
        assert_eq!(clock(&d), 2_807 + 40, "a handle mapped again");
        d.unmap(va, 4 << 20).expect("mapped");
        d.unmap(DevicePtr(va.0 + (4 << 20)), 4 << 20)
            .expect("mapped");
        d.release_physical_page(h).expect("unmapped");
        d.free_address_range(va, 8 << 20).expect("reserved");
        d.synchronize_stream(StreamId(3)).expect("sync");
        assert_eq!(clock(&d), 2_847 + 2 * 20 + 10 + 7);
        // malloc, free; reserve, create, map+access twice, unmap twice, release, free the
        // range; the stream synchronisation.
        assert_eq!(d.stats().driver_calls(), 2 + 1 + 1 + 4 + 2 + 1 + 1 + 1);
    }
}
