//! The `transformer` zoo model: its spec syntax, PyTorch parameter names, that it learns a tiny
//! synthetic token task when pipelined over two devices with 1F1B, and that every schedule on two
//! and four devices gives bit-for-bit the weights of one device with the same micro-batches.
mod common;

use common::{SCHEDULES, max_rel_diff, trainer, weights};
use conveyor::engine::runtime::Recompute;
use conveyor::engine::{Device, Tensor};
use conveyor::schedules::ScheduleKind;
use conveyor::zoo::{ModelSpec, TransformerConfig};

/// Training steps of the learning test: by 60 the loss on fresh batches falls from ≈ 1.4 (ln 4)
/// to below 0.1.
const STEPS: usize = 60;

/// 8 token ids, 4 tokens, width 16, 2 heads, 2 blocks, 4 classes.
const SPEC: &str = "transformer:8,4,16,2,2,4";

/// Seeded token ids `[rows, tokens]` in `0..vocab` (as f32) and labels `ids[r, 0] mod classes`: a
/// task only a model that tells positions apart can learn.
fn token_data(config: &TransformerConfig, rows: usize, seed: u64) -> (Tensor, Vec<usize>) {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % config.vocab as u64) as usize
    };
    let ids: Vec<usize> = (0..rows * config.tokens).map(|_| next()).collect();
    let labels = ids.chunks(config.tokens).map(|row| row[0] % config.classes).collect();
    let values = ids.iter().map(|&id| id as f32).collect();
    (Tensor::from_vec(values, [rows, config.tokens], &Device::host()).unwrap(), labels)
}

fn config() -> TransformerConfig {
    match SPEC.parse::<ModelSpec>().unwrap() {
        ModelSpec::Transformer(config) => config,
        other => panic!("{SPEC} parsed as {other:?}"),
    }
}

#[test]
fn spec_parses_and_names_parameters_like_pytorch() {
    let config = config();
    assert_eq!(
        config,
        TransformerConfig {
            vocab: 8,
            tokens: 4,
            dim: 16,
            n_heads: 2,
            n_layers: 2,
            classes: 4,
            tied: false,
            sequence_parallel: false
        }
    );
    assert_eq!("transformer".parse::<ModelSpec>().unwrap(), ModelSpec::Transformer(TransformerConfig::default()));
    for bad in ["transformer:8,4,16,3,2,4", "transformer:8,4,16,2,2", "transformer:8,4,0,2,2,4", "transformer:a"] {
        assert!(bad.parse::<ModelSpec>().is_err(), "{bad} should not parse");
    }
    let spec = ModelSpec::Transformer(config);
    assert_eq!(spec.input_shape(), vec![4]);
    let graph = spec.build(0).unwrap();
    let names: Vec<String> =
        graph.parameter_names().into_iter().map(|(name, shape)| format!("{name} {shape}")).collect();
    let block0: Vec<&str> = names.iter().map(String::as_str).filter(|n| n.starts_with("blocks.0.")).collect();
    assert_eq!(names[..2], ["embed.weight [8, 16]".to_string(), "pos.weight [4, 16]".to_string()]);
    assert_eq!(
        block0,
        [
            "blocks.0.ln1.weight [16]",
            "blocks.0.ln1.bias [16]",
            "blocks.0.attn.in_proj_weight [48, 16]",
            "blocks.0.attn.in_proj_bias [48]",
            "blocks.0.attn.out_proj.weight [16, 16]",
            "blocks.0.attn.out_proj.bias [16]",
            "blocks.0.ln2.weight [16]",
            "blocks.0.ln2.bias [16]",
            "blocks.0.fc1.weight [64, 16]",
            "blocks.0.fc1.bias [64]",
            "blocks.0.fc2.weight [16, 64]",
            "blocks.0.fc2.bias [16]",
        ]
    );
    assert_eq!(
        names[names.len() - 4..],
        ["ln_f.weight [16]", "ln_f.bias [16]", "head.weight [4, 16]", "head.bias [4]"]
    );
    // The existing specs are untouched.
    assert_eq!("resnet".parse::<ModelSpec>().unwrap(), ModelSpec::Resnet);
}

#[test]
fn learns_a_token_task_on_two_devices_with_one_f_one_b() {
    let config = config();
    let spec = ModelSpec::Transformer(config);
    let mut t = trainer(spec.build(1).unwrap(), 2, ScheduleKind::OneFOneB, 1, 4, Recompute::Never);
    // A fresh batch every step, so a falling loss means the rule was learned, not the rows.
    let losses: Vec<f64> = (0..STEPS)
        .map(|step| {
            let (x, y) = token_data(&config, 32, step as u64);
            t.train_step(&x, &y).unwrap().loss
        })
        .collect();
    let mean = |window: &[f64]| window.iter().sum::<f64>() / window.len() as f64;
    let (first, last) = (mean(&losses[..5]), mean(&losses[STEPS - 5..]));
    assert!(losses.iter().all(|l| l.is_finite()), "losses {losses:?}");
    assert!(last < 0.25 * first, "mean loss should fall to under a quarter: {first} -> {last} ({losses:?})");
}

fn train(n_devices: usize, kind: ScheduleKind, n_chunks: usize) -> Vec<(String, Vec<f32>)> {
    let config = config();
    let mut t =
        trainer(ModelSpec::Transformer(config).build(3).unwrap(), n_devices, kind, n_chunks, 4, Recompute::Never);
    for step in 0..3 {
        let (x, y) = token_data(&config, 16, step);
        t.train_step(&x, &y).unwrap();
    }
    weights(&t)
}

#[test]
fn pipelines_give_the_single_device_weights_bit_for_bit() {
    let single = train(1, ScheduleKind::GPipe, 1);
    for n_devices in [2, 4] {
        for (kind, chunks) in SCHEDULES {
            let piped = train(n_devices, kind, chunks);
            assert!(
                piped == single,
                "{kind} on {n_devices} devices: weights differ from one device by up to {}",
                max_rel_diff(&piped, &single)
            );
        }
    }
}
