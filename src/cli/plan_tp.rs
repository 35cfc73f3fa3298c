//! `conveyor plan --tensor-parallel K`: the plan of a model whose stages each hold a group of K
//! devices with their layers split over it (`conveyor::pipeline::plan_tensor_parallel`, the plan
//! `train --tensor-parallel K` runs), every device of every group against its own budget, and the
//! split layers' collectives per micro-batch priced on the plan's link and added to their stage's
//! forward, input-gradient and weight-gradient times before the schedule is simulated.
use super::console::outln;

use conveyor::engine::Device;
use conveyor::engine::placement::{Plan, format_bytes, format_seconds};
use conveyor::pipeline::{PipelineConfig, StageCollectives, plan_tensor_parallel, tensor_parallel_collectives};
use conveyor::zoo::ModelSpec;

use super::plan::{PlanArgs, engine_reason, explain_memory, plan_json, print_table, simulate_plan};
use super::usage;

/// Plans `spec` on `devices` in groups of `args.tensor_parallel` and prints (or writes as JSON)
/// the plan, the predicted step and each stage's collectives.
pub(super) fn run(
    args: &PlanArgs,
    spec: &ModelSpec,
    devices: &[Device],
    config: &PipelineConfig,
    budget: Option<u64>,
) -> anyhow::Result<()> {
    let k = args.tensor_parallel;
    if args.auto_schedule {
        return Err(usage(format!(
            "--schedule auto with --tensor-parallel {k}: the search plans whole layers only; give a schedule"
        )));
    }
    if args.placement != "auto" {
        return Err(usage(format!(
            "--placement {} with --tensor-parallel {k}: split stages are placed automatically; give --placement auto",
            args.placement
        )));
    }
    if args.data_parallel > 1 {
        return Err(usage(format!(
            "--data-parallel {} with --tensor-parallel {k}: `conveyor plan` plans one of these at a time (train runs \
             both); give one",
            args.data_parallel
        )));
    }
    if !devices.len().is_multiple_of(k) {
        return Err(usage(format!(
            "--tensor-parallel {k}: the {} devices of --devices {} do not split into groups of {k}; give stages x {k} \
             devices",
            devices.len(),
            args.devices
        )));
    }
    // The graph's parameters are zeros the operating system maps only when written (see `plan`).
    let (mut plan, graph) =
        conveyor::engine::init::with_unwritten_parameters(|| plan_tensor_parallel(spec, 0, devices, k, config))
            .map_err(|e| match e {
                conveyor::engine::Error::DoesNotFit { .. } => explain_memory(e, args, budget),
                other => usage(format!("--model {} --tensor-parallel {k}: {}", args.model, engine_reason(other))),
            })?;
    let collectives = tensor_parallel_collectives(&graph, &plan)?;
    let link = plan.config.link;
    for (stage, traffic) in plan.stages.iter_mut().zip(&collectives) {
        let (forward, backward_input, backward_weight) = traffic.seconds(&link);
        stage.forward_s += forward;
        stage.backward_input_s += backward_input;
        stage.backward_weight_s += backward_weight;
    }
    let n_groups = devices.len() / k;
    let prediction = simulate_plan(&plan, args, n_groups, None)?;
    if args.json {
        let mut json = plan_json(&plan, &prediction, args, &graph, n_groups);
        json["tensor_parallel"] = tensor_parallel_json(&plan, &collectives, devices, k);
        outln!("{}", serde_json::to_string(&json)?);
        return Ok(());
    }
    print_table(&plan, &prediction, args, plan.config.micro_batch_rows, n_groups);
    print_groups(&plan, &collectives, devices, k);
    Ok(())
}

/// The devices of stage `stage`'s group.
fn group_of<'a>(plan: &Plan, stage: usize, devices: &'a [Device], k: usize) -> &'a [Device] {
    let group = plan.stages[stage].device_idx;
    &devices[group * k..(group + 1) * k]
}

/// Each device's planned total for a stage: the first device's, then the other members'.
fn member_totals(plan: &Plan, stage: usize) -> Vec<u64> {
    let s = &plan.stages[stage];
    std::iter::once(s.memory.total()).chain(s.member_memory.iter().map(|m| m.total())).collect()
}

fn print_groups(plan: &Plan, collectives: &[StageCollectives], devices: &[Device], k: usize) {
    let link = plan.config.link;
    outln!(
        "tensor parallelism: {k} devices per stage; memory per device (each against its own budget), and the split \
         layers' collectives per micro-batch through the busiest device, priced at {} per message and {:.1} GB/s \
         (included in F, B and W above):",
        format_seconds(link.latency_s),
        link.bandwidth_bytes_per_s / 1e9
    );
    for (stage, traffic) in collectives.iter().enumerate() {
        let group = group_of(plan, stage, devices, k);
        let memory: Vec<String> = group
            .iter()
            .zip(member_totals(plan, stage))
            .map(|(device, total)| format!("{device} {}", format_bytes(total)))
            .collect();
        let (f, b, w) = traffic.seconds(&link);
        let part = |name: &str, t: &conveyor::engine::collective::Traffic, s: f64| {
            format!("{name} {} msgs {} {}", t.messages, format_bytes(t.bytes as u64), format_seconds(s))
        };
        outln!(
            "  stage {stage}: {}; collectives {}, {}, {}",
            memory.join(", "),
            part("F", &traffic.forward, f),
            part("B", &traffic.backward_input, b),
            part("W", &traffic.backward_weight, w)
        );
    }
}

fn tensor_parallel_json(
    plan: &Plan,
    collectives: &[StageCollectives],
    devices: &[Device],
    k: usize,
) -> serde_json::Value {
    let link = plan.config.link;
    let stages: Vec<serde_json::Value> = collectives
        .iter()
        .enumerate()
        .map(|(stage, traffic)| {
            let (f, b, w) = traffic.seconds(&link);
            let group: Vec<String> = group_of(plan, stage, devices, k).iter().map(Device::to_string).collect();
            let phase = |t: &conveyor::engine::collective::Traffic, s: f64| {
                serde_json::json!({ "messages": t.messages, "bytes": t.bytes, "predicted_s": s })
            };
            serde_json::json!({
                "stage": stage,
                "devices": group,
                "memory_bytes": member_totals(plan, stage),
                "forward": phase(&traffic.forward, f),
                "backward_input": phase(&traffic.backward_input, b),
                "backward_weight": phase(&traffic.backward_weight, w),
            })
        })
        .collect();
    serde_json::json!({ "degree": k, "stages": stages })
}
