//! A pipeline whose stages are MPI ranks, from the library: every rank runs this same program,
//! builds the same trainer with the MPI transport, and trains; rank 0 prints and saves. The
//! trainer's calls are collectives across the ranks (steps, `predict`, `parameters`, `save`), so
//! every rank makes them in the same order.
//!
//! ```text
//! cargo build --release --features mpi --example mpi_pipeline
//! mpirun -n 2 target/release/examples/mpi_pipeline        # as root: see the README's MPI section
//! ```
//! Without the `mpi` feature it says how to build with it.
use anyhow::Result;
use conveyor::Sequential;
use conveyor::engine::optim::OptimizerConfig;
use conveyor::engine::placement::Placement;
use conveyor::engine::runtime::Trainer;
use conveyor::engine::transport::{self, MpiTransport, Transport};
use conveyor::engine::{Device, Tensor};
use conveyor::layers::CrossEntropyLoss;
use conveyor::schedules::ScheduleKind;

fn main() -> Result<()> {
    let mpi = MpiTransport::init()?;
    let (rank, ranks) = (mpi.rank(), mpi.world_size());
    transport::init_process(mpi)?;
    let result = train(rank, ranks);
    // Every rank lets go of MPI together (after dropping its trainer, inside `train`).
    transport::finish_process();
    result
}

fn train(rank: usize, ranks: usize) -> Result<()> {
    // One pipeline device per rank; the same seed on every rank gives every rank the same model.
    let graph = Sequential::new([16]).linear(64).relu().linear(64).relu().linear(64).relu().linear(4).build(7)?;
    let mut trainer = Trainer::builder(graph, std::sync::Arc::new(CrossEntropyLoss::new()))
        .devices((0..ranks).map(Device::cpu).collect())
        .placement(Placement::auto())
        .batch_rows(32)
        .schedule(ScheduleKind::OneFOneB, 1)
        .micro_batches(4)
        .optimizer(OptimizerConfig::sgd(0.1))
        .build()?;
    // Every rank makes the same batches (a real run reads the same data file on every rank).
    let x =
        Tensor::from_vec((0..32 * 16).map(|i| ((i * 7 % 13) as f32 - 6.0) / 6.0).collect(), [32, 16], &Device::host())?;
    let labels: Vec<usize> = (0..32).map(|i| i % 4).collect();
    for step in 0..20 {
        let report = trainer.train_step(&x, &labels)?;
        if rank == 0 && step % 5 == 4 {
            println!(
                "step {:>2}: loss {:.4}, {} ops on {} ranks",
                step + 1,
                report.loss,
                report.timeline.events.len(),
                ranks
            );
        }
    }
    let predicted = trainer.predict(&x)?; // gathered from the last stage's rank onto every rank
    if rank == 0 {
        println!("predicted {:?} on rank 0", predicted.dims());
    }
    let path = std::env::temp_dir().join("conveyor-mpi-pipeline.safetensors");
    trainer.save(&path)?; // every rank gathers; rank 0 writes
    if trainer.writes_files() {
        println!("saved {}", path.display());
        std::fs::remove_file(&path)?;
    }
    Ok(())
}
