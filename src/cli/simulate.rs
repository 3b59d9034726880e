//! `gpumem simulate`: a synthetic training loop on a simulated GPU.

use std::process::ExitCode;

use gpumem::allocator::size::format_size;
use gpumem::config::Syntax;
use gpumem::demo::workload::{TrainingWorkload, finish_communication};
use gpumem::device::SimConfig;
use gpumem::{AllocatorConfig, CachingAllocator, SimDevice};

use super::{CliResult, Path, out, outln};

#[derive(clap::Args)]
pub(crate) struct Args {
    /// Allocator settings in PYTORCH_CUDA_ALLOC_CONF syntax.
    #[arg(long, default_value = "")]
    config: String,
    /// Simulated device memory in GiB.
    #[arg(long, default_value_t = 80)]
    capacity_gib: u64,
    /// Per-process memory fraction (set_per_process_memory_fraction; enables
    /// garbage_collection_threshold).
    #[arg(long)]
    memory_fraction: Option<f64>,
    /// Training steps.
    #[arg(long, default_value_t = 20)]
    steps: u32,
    /// Transformer layers.
    #[arg(long, default_value_t = 24)]
    layers: u32,
    /// Longest sequence length (each step draws between a quarter of it and all of it).
    #[arg(long, default_value_t = 2048)]
    max_seq: u64,
    /// Seed for sequence lengths.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also capture a CUDA graph (its private pool keeps the capture's scratch) and allocate
    /// the gradient buckets in a MemPool, as inference servers and NCCL's symmetric memory do.
    #[arg(long)]
    private_pools: bool,
    /// Also share each step's weights over CUDA IPC with a consumer that holds them until
    /// the next step (an RL trainer's weight sync): they wait in the limbo, collected by the
    /// retry chain's cuda_ipc_collect.
    #[arg(long)]
    ipc: bool,
    /// Print memory_stats() as JSON instead of the summary.
    #[arg(long)]
    json: bool,
    /// Write a memory snapshot (PyTorch's schema, JSON) to this file.
    #[arg(long)]
    snapshot: Option<Path>,
    /// Trace entries the snapshot keeps, newest last (`_record_memory_history`'s
    /// `max_entries`; PyTorch's default is 100 000).
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    history: u64,
    /// The PyTorch release whose decisions the allocator follows (2.0 to 2.15).
    #[arg(long, value_name = "MAJOR.MINOR", default_value_t = gpumem::config::PyTorchVersion::LATEST)]
    pytorch: gpumem::config::PyTorchVersion,
}

pub(crate) fn run(args: Args) -> CliResult {
    let config = AllocatorConfig::parse_for(&args.config, Syntax::PyTorch, args.pytorch)?;
    let capacity = args
        .capacity_gib
        .checked_mul(1 << 30)
        .ok_or("--capacity-gib is too large")?;
    let device = SimDevice::new(SimConfig::with_capacity(capacity));
    let mut alloc = CachingAllocator::new(device, config);
    if let Some(fraction) = args.memory_fraction {
        alloc.set_memory_fraction(fraction)?;
    }
    alloc.record_history(Some(args.history as usize));
    let workload = TrainingWorkload {
        steps: args.steps,
        layers: args.layers,
        max_seq: args.max_seq,
        seed: args.seed,
        private_pools: args.private_pools,
        ipc: args.ipc,
        ..TrainingWorkload::default()
    };
    let report = workload.run(&mut alloc, finish_communication)?;
    if let Some(path) = args.snapshot {
        super::write_output(&path, &serde_json::to_vec(&alloc.snapshot())?, &[])?;
    }
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&alloc.memory_stats())?)?;
    } else {
        out!("{}", alloc.memory_summary(false))?;
        let s = alloc.stats();
        let peak_alloc = s.allocated_bytes.all().peak as u64;
        let peak_reserved = s.reserved_bytes.all().peak as u64;
        outln!(
            "steps {}/{}, {} allocations; peak allocated {}, peak reserved {} (ratio {:.3}); \
             device allocs {}, device frees {}, retries {}, OOMs {}; simulated driver time {:.3} ms",
            report.steps_completed,
            args.steps,
            report.mallocs,
            format_size(peak_alloc),
            format_size(peak_reserved),
            peak_reserved as f64 / peak_alloc.max(1) as f64,
            s.num_device_alloc.get(),
            s.num_device_free.get(),
            s.num_alloc_retries.get(),
            s.num_ooms.get(),
            alloc.device().stats().driver_time_ns as f64 / 1e6,
        )?;
        if args.ipc {
            outln!(
                "IPC: {} blocks shared, {} freed by the retry chain's cuda_ipc_collect",
                report.shared,
                report.collected_in_retry
            )?;
        }
    }
    if let Some(oom) = report.oom {
        eprintln!("{oom}");
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}
