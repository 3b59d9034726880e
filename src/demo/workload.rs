//! A synthetic training workload that drives the allocator the way a transformer training
//! loop does: persistent weights and optimizer state, activations that pile up through the
//! forward pass and are freed in reverse during the backward pass, gradients, a temporary
//! workspace per layer, variable sequence lengths from step to step (the classic source of
//! fragmentation), and gradient buckets handed to a communication stream (`record_stream`).
//! With `private_pools`, as an inference-serving or `reduce-overhead` job does: a CUDA graph
//! captured after the weights (its pool keeps the capture's scratch cached while the graph
//! lives, and is released at the end), and the gradient buckets allocated in a MemPool (as
//! NCCL's symmetric memory is). With `ipc`, as a reinforcement-learning trainer does: after
//! each step the trainer gathers its weights into buckets and shares them over CUDA IPC with a
//! rollout engine (as verl and OpenRLHF sync weights), dropping its own reference at once;
//! the engine holds them until the next step starts, so they wait in the trainer's limbo
//! until a request that misses the cache runs the retry chain's `cuda_ipc_collect`, or the
//! trainer's next release of a shared block collects them (see [`crate::ipc`]).
//!
//! Deterministic for a given seed, so runs can be compared across configurations.

use crate::allocator::{
    AllocError, CachingAllocator, PoolId, PoolOptions, RouteKind, StreamFilter,
};
use crate::device::{Device, DevicePtr, SimDevice, StreamId};
use crate::ipc::{IpcSender, Received};
use crate::rng::XorShift;

/// The communication stream's handle (an arbitrary non-default stream).
pub const COMM_STREAM: StreamId = StreamId(0x5000);

/// The stream a CUDA graph is captured on (captures need a non-default stream).
pub const CAPTURE_STREAM: StreamId = StreamId(0x6000);

/// The captured graph's own pool (a capture's `(id, 0)`).
pub const GRAPH_POOL: PoolId = PoolId(1, 0);

/// The gradient buckets' MemPool (`(0, id)`).
pub const BUCKET_POOL: PoolId = PoolId(0, 1);

/// Shape of the synthetic model and run.
#[derive(Clone, Debug)]
pub struct TrainingWorkload {
    /// Transformer layers.
    pub layers: u32,
    /// Hidden size.
    pub hidden: u64,
    /// Micro-batch size.
    pub batch: u64,
    /// Longest sequence; each step draws a length between a quarter of it and all of it.
    pub max_seq: u64,
    /// Bytes per element (2 for bf16).
    pub element_bytes: u64,
    /// Training steps.
    pub steps: u32,
    /// Random seed for sequence lengths.
    pub seed: u64,
    /// A captured CUDA graph and a MemPool for the gradient buckets (see the module doc).
    pub private_pools: bool,
    /// Weights shared over IPC after each step, held by a consumer until the next (see the
    /// module doc).
    pub ipc: bool,
}

impl Default for TrainingWorkload {
    fn default() -> Self {
        TrainingWorkload {
            layers: 24,
            hidden: 2048,
            batch: 8,
            max_seq: 2048,
            element_bytes: 2,
            steps: 20,
            seed: 1,
            private_pools: false,
            ipc: false,
        }
    }
}

/// What a run did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkloadReport {
    /// Steps that completed.
    pub steps_completed: u32,
    /// Allocations served.
    pub mallocs: u64,
    /// The out-of-memory error that stopped the run, if any.
    pub oom: Option<String>,
    /// With `ipc`: blocks shared with the consumer.
    pub shared: u64,
    /// With `ipc`: shared blocks the retry chain's `cuda_ipc_collect` freed (the others were
    /// freed when the trainer released another shared block, or at the end).
    pub collected_in_retry: u64,
}

impl TrainingWorkload {
    /// Runs the workload on `alloc`, calling `after_step` at the end of every step (where a
    /// simulated device's communication stream can finish its work). Stops at the first
    /// out-of-memory error and reports it; device failures are returned.
    ///
    /// # Errors
    /// Any [`AllocError`] other than out-of-memory.
    pub fn run<D: Device>(
        &self,
        alloc: &mut CachingAllocator<D>,
        mut after_step: impl FnMut(&mut CachingAllocator<D>),
    ) -> Result<WorkloadReport, AllocError> {
        let mut report = WorkloadReport::default();
        let mut held: Vec<DevicePtr> = Vec::new();
        let mut sharing = self.ipc.then(|| Sharing::register(alloc));
        let served_before = alloc.stats().allocation.all().allocated;
        let outcome = self.run_inner(
            alloc,
            &mut report,
            &mut held,
            sharing.as_mut(),
            &mut after_step,
        );
        report.mallocs = (alloc.stats().allocation.all().allocated - served_before) as u64;
        match outcome {
            Ok(()) => {}
            Err(e) if e.is_out_of_memory() => report.oom = Some(e.to_string()),
            Err(e) => return Err(e),
        }
        for ptr in held {
            alloc.free(ptr)?;
        }
        if let Some(mut sharing) = sharing {
            // The engine exits: every shared block is let go of and collected.
            sharing.engine.clear();
            for ptr in sharing.sender.collect() {
                alloc.free(ptr)?;
                sharing.freed += 1;
            }
            report.shared = sharing.sent;
            report.collected_in_retry = sharing.sent - sharing.freed;
        }
        if self.private_pools {
            // The graph is destroyed and the MemPool object dropped: both pools are freeable.
            for pool in [GRAPH_POOL, BUCKET_POOL] {
                if alloc.pool_use_count(pool).is_some() {
                    alloc.release_pool(pool)?;
                }
            }
        }
        Ok(report)
    }

    fn run_inner<D: Device>(
        &self,
        alloc: &mut CachingAllocator<D>,
        report: &mut WorkloadReport,
        held: &mut Vec<DevicePtr>,
        mut sharing: Option<&mut Sharing>,
        after_step: &mut impl FnMut(&mut CachingAllocator<D>),
    ) -> Result<(), AllocError> {
        let h = self.hidden;
        let e = self.element_bytes;
        let malloc =
            |alloc: &mut CachingAllocator<D>, size: u64| alloc.malloc(size, StreamId::DEFAULT);
        // Weights, gradients' master copy and two Adam moments per layer (fp32 state).
        let layer_params = 12 * h * h + 13 * h;
        for _ in 0..self.layers {
            for bytes in [layer_params * e, layer_params * 4, layer_params * 4] {
                held.push(malloc(alloc, bytes)?);
            }
        }
        if self.private_pools {
            self.capture_graph(alloc, held)?;
            alloc.create_pool(BUCKET_POOL, PoolOptions::default())?;
        }
        let mut rng = XorShift::new(self.seed);
        for _ in 0..self.steps {
            if let Some(sharing) = sharing.as_deref_mut() {
                // The engine loaded the last step's weights and lets go of them.
                sharing.engine.clear();
            }
            let seq = rng.between(self.max_seq / 4, self.max_seq).max(1);
            let tokens = self.batch * seq;
            let mut activations = Vec::new();
            for _ in 0..self.layers {
                // Attention inputs, scores (batch × heads × seq²), MLP intermediate, norms.
                let heads = (h / 128).max(1);
                for bytes in [
                    tokens * h * e,
                    3 * tokens * h * e,
                    self.batch * heads * seq * seq * e,
                    4 * tokens * h * e,
                    tokens * 4,
                ] {
                    activations.push(malloc(alloc, bytes)?);
                }
                // A short-lived workspace, freed before the next layer.
                let workspace = malloc(alloc, tokens * h * e / 2)?;
                alloc.free(workspace)?;
            }
            let mut gradient_bucket = Vec::new();
            for _ in 0..self.layers {
                for ptr in activations
                    .drain(activations.len().saturating_sub(5)..)
                    .rev()
                {
                    alloc.free(ptr)?;
                }
                let grad = if self.private_pools {
                    let filter = StreamFilter::Streams(vec![StreamId::DEFAULT]);
                    alloc.begin_allocate_to_pool(BUCKET_POOL, filter, RouteKind::MemPool)?;
                    let grad = malloc(alloc, layer_params * e);
                    // A use_mem_pool scope: its route's use is given back on exit.
                    alloc.end_allocate_to_pool(BUCKET_POOL)?;
                    alloc.release_pool(BUCKET_POOL)?;
                    grad?
                } else {
                    malloc(alloc, layer_params * e)?
                };
                // The gradient is all-reduced on the communication stream.
                alloc.record_stream(grad, COMM_STREAM);
                gradient_bucket.push(grad);
                let temp = malloc(alloc, tokens * h * e)?;
                alloc.free(temp)?;
            }
            for grad in gradient_bucket {
                alloc.free(grad)?;
            }
            if let Some(sharing) = sharing.as_deref_mut() {
                // Two layers' weights per bucket.
                for _ in 0..self.layers.div_ceil(2) {
                    sharing.share(alloc, 2 * layer_params * e)?;
                }
            }
            after_step(alloc);
            report.steps_completed += 1;
        }
        Ok(())
    }
}

/// The trainer's side of the weight sync and the engine's references (the `ipc` option).
struct Sharing {
    sender: std::sync::Arc<IpcSender>,
    engine: Vec<Received>,
    /// Blocks sent.
    sent: u64,
    /// Sent blocks freed here (not by the allocator's callback).
    freed: u64,
}

impl Sharing {
    /// A sender registered as the allocator's `cuda_ipc_collect`.
    fn register<D: Device>(alloc: &mut CachingAllocator<D>) -> Sharing {
        let sender = std::sync::Arc::new(IpcSender::new());
        alloc.register_free_memory_callback(sender.clone());
        Sharing {
            sender,
            engine: Vec::new(),
            sent: 0,
            freed: 0,
        }
    }

    /// One bucket of `bytes` allocated, sent to the engine and released by the trainer.
    fn share<D: Device>(
        &mut self,
        alloc: &mut CachingAllocator<D>,
        bytes: u64,
    ) -> Result<(), AllocError> {
        let bucket = alloc.malloc(bytes, StreamId::DEFAULT)?;
        let handle = alloc.share_handle(bucket)?;
        self.engine.push(self.sender.send(bucket, handle));
        self.sent += 1;
        for ptr in self.sender.release_storage(bucket) {
            alloc.free(ptr)?;
            self.freed += 1;
        }
        Ok(())
    }
}

impl TrainingWorkload {
    /// Captures a graph of one decoding pass on [`CAPTURE_STREAM`]: per layer, a projection
    /// and a scratch freed inside the capture (cached in the graph's pool for its replays),
    /// the output kept in `held`. The graph lives for the run: its pool's use stays.
    fn capture_graph<D: Device>(
        &self,
        alloc: &mut CachingAllocator<D>,
        held: &mut Vec<DevicePtr>,
    ) -> Result<(), AllocError> {
        let tokens = self.batch * (self.max_seq / 4).max(1);
        let bytes = tokens * self.hidden * self.element_bytes;
        let filter = StreamFilter::Streams(vec![CAPTURE_STREAM]);
        alloc.begin_allocate_to_pool(GRAPH_POOL, filter, RouteKind::Capture)?;
        let captured = self.captured_layers(alloc, bytes);
        alloc.end_allocate_to_pool(GRAPH_POOL)?;
        held.extend(captured?);
        Ok(())
    }

    /// The captured pass's allocations; the last layer's output is returned live.
    fn captured_layers<D: Device>(
        &self,
        alloc: &mut CachingAllocator<D>,
        bytes: u64,
    ) -> Result<Option<DevicePtr>, AllocError> {
        let mut previous = None;
        for _ in 0..self.layers {
            let projection = alloc.malloc(3 * bytes, CAPTURE_STREAM)?;
            let scratch = alloc.malloc(bytes, CAPTURE_STREAM)?;
            alloc.free(scratch)?;
            if let Some(p) = previous.replace(projection) {
                alloc.free(p)?;
            }
        }
        Ok(previous)
    }
}

/// Completes the communication stream's work on a simulated device, as the all-reduce of a
/// step finishing would.
pub fn finish_communication(alloc: &mut CachingAllocator<SimDevice>) {
    alloc.device_mut().complete_stream(COMM_STREAM);
}
