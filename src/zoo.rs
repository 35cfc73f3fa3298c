//! The model zoo: model specs (`mlp:64,128,10`, `cnn`, `resnet`, `transformer:32,16,32,4,2,10`)
//! parsed into graphs whose node names give PyTorch's state-dict names for the equivalent module.
//!
//! `mlp:D0,D1,...,Dn` is `nn.Sequential(Linear(D0, D1), ReLU(), Linear(D1, D2), ..., Linear(Dn-1, Dn))`:
//! Linear nodes are named `0`, `2`, `4`, ... and ReLUs `1`, `3`, ..., so parameters are
//! `0.weight`, `0.bias`, `2.weight`, ... exactly as PyTorch names them.
//!
//! `transformer:VOCAB,T,D,H,L,C` (or `transformer` for [`TransformerConfig::default`]) is a
//! pre-norm encoder classifier over token ids; see [`transformer`].
//!
//! Tensor parallelism: [`ModelSpec::build_split`] builds the model's tensor-parallel form (the
//! same initial values drawn in the same order, the same parameter names) with chosen nodes split
//! over groups of devices: Linears alternate column- and row-parallel along the model (Megatron's
//! column-then-row pairs), convolutions split their output channels (AlexNet), a transformer's
//! attention splits by heads and its MLP block column-then-row. The form has the nodes of
//! [`ModelSpec::build`] but for the transformer's MLP blocks: `fc1`, `act`, `fc2` of block `i`
//! are one node there, `blocks.i` (a [`ParallelMlp`], so its parameters keep their names
//! `blocks.i.fc1.weight` ...), whose hidden activation never leaves its shard: one all-reduce
//! forward and one backward per block, as in Megatron. Checkpoints of either form carry the
//! unsplit tensors under the unsplit names, so they load into the other. With sequence parallelism
//! ([`TransformerConfig::sequence_parallel`], `--sequence-parallel`) each whole block of the
//! transformer is one node `blocks.i` there instead (a [`ParallelTransformerBlock`]: parameters
//! `blocks.i.ln1.weight` ... `blocks.i.fc2.bias`, the same names), its LayerNorm and residual
//! regions split along the tokens.
use std::collections::HashMap;

use conveyor_engine::graph::Graph;
use conveyor_engine::{Device, Error, Layer, Result, init};
use conveyor_layers::{
    Add, ChannelParallelConv2d, ColumnParallelLinear, Conv2d, Conv2dOptions, Dropout, Embedding, Flatten, Gelu,
    LayerNorm, Linear, MaxPool2d, MeanOverTokens, MlpActivation, MultiheadSelfAttention, ParallelMlp,
    ParallelSelfAttention, ParallelTransformerBlock, PositionalEmbedding, RankShard, Relu, RowParallelLinear, Shards,
    VocabParallelEmbedding,
};
use rand::rngs::StdRng;

use crate::limits::{
    MAX_CLASSES, MAX_LAYER_PARAMETERS, MAX_LAYERS, MAX_TOKENS, MAX_WIDTH, checked_product, parse_count,
};

/// Which nodes to split and over which devices: node name → the devices of its stage's group
/// (the group's first device is the stage's device). Nodes absent, groups of one device, and
/// nodes that cannot be split (no parameters, or fewer features than devices) stay whole.
pub type TensorParallelSplits = HashMap<String, Vec<Device>>;

/// A parsed model spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSpec {
    /// Linear/ReLU stack with these widths (input first, classes last).
    Mlp(Vec<usize>),
    /// A LeNet-like CNN for 1x8x8 images and 10 classes.
    Cnn,
    /// A small residual CNN for 1x8x8 images and 10 classes.
    Resnet,
    /// The same residual CNN for 1 x SIDE x SIDE images (`resnet:SIDE`, SIDE even, 4 to 256;
    /// MNIST-like data: `resnet:28`); `resnet:8` is [`ModelSpec::Resnet`].
    ResnetImages(usize),
    /// A pre-norm transformer encoder classifier over token ids (see [`transformer`]).
    Transformer(TransformerConfig),
}

/// Sizes of the [`transformer`] model: `transformer:VOCAB,T,D,H,L,C` in a spec, with `,tied` for
/// an output projection tied to the token embedding (`C` = `VOCAB`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransformerConfig {
    /// Token ids are in `0..vocab`.
    pub vocab: usize,
    /// Tokens per sample (the input is `[batch, tokens]`).
    pub tokens: usize,
    /// Model width `D`.
    pub dim: usize,
    /// Attention heads; must divide `dim`.
    pub n_heads: usize,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Output classes.
    pub classes: usize,
    /// The output projection's weight is the token embedding's (`head.weight = embed.weight`, as
    /// language models tie them); needs `classes == vocab`.
    pub tied: bool,
    /// Sequence parallelism (`--sequence-parallel`, Megatron's): in the tensor-parallel form each
    /// block is one node `blocks.i`, a [`ParallelTransformerBlock`] whose LayerNorm and residual
    /// regions are split along the tokens across the node's group. The same parameters and names
    /// as without; [`ModelSpec::build`]'s graph ignores it.
    pub sequence_parallel: bool,
}

impl Default for TransformerConfig {
    /// `transformer:32,16,32,4,2,10`: 32 token ids, 16 tokens, width 32, 4 heads, 2 blocks, 10 classes.
    fn default() -> Self {
        TransformerConfig {
            vocab: 32,
            tokens: 16,
            dim: 32,
            n_heads: 4,
            n_layers: 2,
            classes: 10,
            tied: false,
            sequence_parallel: false,
        }
    }
}

impl std::str::FromStr for ModelSpec {
    type Err = Error;
    /// Parses a spec, refusing sizes over the limits of [`crate::limits`] (widths, parameters per
    /// layer, layers, tokens, classes) before anything is built.
    fn from_str(spec: &str) -> Result<Self> {
        let bad = |reason: String| Error::invalid("model spec", format!("`{spec}`: {reason}"));
        match spec.split_once(':') {
            Some(("mlp", dims)) => {
                let dims = dims
                    .split(',')
                    .map(|d| parse_count(d, MAX_WIDTH, "MAX_WIDTH"))
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .map_err(|why| bad(format!("{why}; widths are positive integers, e.g. mlp:64,128,10")))?;
                if dims.len() < 2 {
                    return Err(bad("an MLP needs at least an input and an output width, e.g. mlp:64,10".into()));
                }
                if dims.len() - 1 > MAX_LAYERS {
                    return Err(bad(format!(
                        "{} Linear layers are over the limit of {MAX_LAYERS} layers; give at most {} widths",
                        dims.len() - 1,
                        MAX_LAYERS + 1
                    )));
                }
                for pair in dims.windows(2) {
                    check_layer(
                        &format!("Linear({}, {})", pair[0], pair[1]),
                        &[checked_product([pair[0], pair[1]]).unwrap_or(usize::MAX), pair[1]],
                    )
                    .map_err(bad)?;
                }
                Ok(ModelSpec::Mlp(dims))
            }
            Some(("transformer", sizes)) => {
                let usage = "sizes must be six positive integers VOCAB,T,D,H,L,C with H dividing D, e.g. \
                             transformer:32,16,32,4,2,10, then `,tied` to tie the output projection to the embedding \
                             (C = VOCAB)";
                let mut parts: Vec<&str> = sizes.split(',').collect();
                let tied = parts.last() == Some(&"tied");
                if tied {
                    parts.pop();
                }
                let &[vocab, tokens, dim, n_heads, n_layers, classes] = parts.as_slice() else {
                    return Err(bad(format!("got {} sizes; {usage}", parts.len())));
                };
                let size = |text: &str, name: &str, max: usize, limit: &str| {
                    parse_count(text, max, limit).map_err(|why| bad(format!("{name}: {why}; {usage}")))
                };
                let vocab = size(vocab, "VOCAB", MAX_WIDTH, "MAX_WIDTH")?;
                let tokens = size(tokens, "T", MAX_TOKENS, "MAX_TOKENS")?;
                let dim = size(dim, "D", MAX_WIDTH, "MAX_WIDTH")?;
                let n_heads = size(n_heads, "H", dim, "D, which H divides")?;
                let n_layers = size(n_layers, "L", MAX_LAYERS, "MAX_LAYERS")?;
                let classes = size(classes, "C", MAX_CLASSES, "MAX_CLASSES")?;
                if !dim.is_multiple_of(n_heads) {
                    return Err(bad(format!("H={n_heads} does not divide D={dim}; {usage}")));
                }
                if tied && classes != vocab {
                    return Err(bad(format!(
                        "tied needs C = VOCAB (the output projection [C, D] is the embedding [VOCAB, D]); got C={classes}, \
                         VOCAB={vocab}"
                    )));
                }
                let layers: [(&str, &[usize]); 5] = [
                    ("embed", &[vocab, dim]),
                    ("pos", &[tokens, dim]),
                    ("attn", &[3, dim, dim]),
                    ("fc1", &[4, dim, dim]),
                    ("head", &[classes, dim]),
                ];
                for (name, factors) in layers {
                    let n = checked_product(factors.iter().copied()).unwrap_or(usize::MAX);
                    check_layer(name, &[n]).map_err(bad)?;
                }
                Ok(ModelSpec::Transformer(TransformerConfig {
                    vocab,
                    tokens,
                    dim,
                    n_heads,
                    n_layers,
                    classes,
                    tied,
                    sequence_parallel: false,
                }))
            }
            None if spec == "cnn" => Ok(ModelSpec::Cnn),
            None if spec == "resnet" => Ok(ModelSpec::Resnet),
            Some(("resnet", side)) => match side.parse::<usize>() {
                Ok(8) => Ok(ModelSpec::Resnet),
                Ok(side) if (4..=256).contains(&side) && side.is_multiple_of(2) => Ok(ModelSpec::ResnetImages(side)),
                _ => Err(bad(format!(
                    "resnet:{side}: the image side must be an even integer from 4 to 256, e.g. resnet:28 for 28x28 images"
                ))),
            },
            None if spec == "transformer" => Ok(ModelSpec::Transformer(TransformerConfig::default())),
            _ => Err(bad(
                "unknown model; use mlp:D0,D1,...,Dn, cnn, resnet[:SIDE] or transformer[:VOCAB,T,D,H,L,C]".into()
            )),
        }
    }
}

/// Refuses a layer whose parameter count (the sum of `counts`, each already within
/// [`MAX_WIDTH`]²) is over [`MAX_LAYER_PARAMETERS`].
fn check_layer(layer: &str, counts: &[usize]) -> std::result::Result<(), String> {
    let n = counts.iter().try_fold(0usize, |sum, &c| sum.checked_add(c)).unwrap_or(usize::MAX);
    if n > MAX_LAYER_PARAMETERS {
        return Err(format!(
            "{layer} has {n} parameters, over the limit of {MAX_LAYER_PARAMETERS} parameters per layer (MAX_LAYER_PARAMETERS)"
        ));
    }
    Ok(())
}

impl ModelSpec {
    /// Builds the graph with parameters drawn from `seed` (PyTorch's default initialisation).
    pub fn build(&self, seed: u64) -> Result<Graph> {
        match self {
            ModelSpec::Mlp(dims) => mlp(dims, seed),
            ModelSpec::Cnn => cnn(seed),
            ModelSpec::Resnet => resnet(seed),
            ModelSpec::ResnetImages(side) => resnet_with(seed, *side, &mut Splitter::new(&TensorParallelSplits::new())),
            ModelSpec::Transformer(config) => transformer(config, seed),
        }
    }

    /// The model's tensor-parallel form with the nodes named in `splits` split over their devices
    /// (see the module docs). With no splits it is [`ModelSpec::build`]'s graph, but for a
    /// transformer, whose MLP blocks are one node each (unsplit); plan and cut a tensor-parallel
    /// model on this form.
    pub fn build_split(&self, seed: u64, splits: &TensorParallelSplits) -> Result<Graph> {
        self.build_split_on(seed, splits, None)
    }

    /// [`ModelSpec::build_split`] for one MPI rank of a run with a rank per tensor-parallel shard:
    /// the nodes whose group holds `here`'s device keep only this rank's shard
    /// ([`Shards::Rank`]); the others are built split as usual (they are another rank's, and the
    /// trainer drops them). The same values are drawn as by [`ModelSpec::build`].
    pub fn build_split_on(&self, seed: u64, splits: &TensorParallelSplits, here: Option<&RankShard>) -> Result<Graph> {
        let mut splitter = Splitter::new(splits);
        splitter.here = here;
        splitter.mlp_blocks_as_nodes = true;
        match self {
            ModelSpec::Mlp(dims) => mlp_with(dims, seed, &mut splitter),
            ModelSpec::Cnn => cnn_with(seed, &mut splitter),
            ModelSpec::Resnet => resnet_with(seed, 8, &mut splitter),
            ModelSpec::ResnetImages(side) => resnet_with(seed, *side, &mut splitter),
            ModelSpec::Transformer(config) => transformer_with(config, seed, &mut splitter),
        }
    }

    /// The same model with sequence parallelism in its tensor-parallel form
    /// ([`TransformerConfig::sequence_parallel`]); an error for a model other than the
    /// transformer, which has no sequence to split.
    pub fn with_sequence_parallel(self) -> Result<ModelSpec> {
        match self {
            ModelSpec::Transformer(config) => {
                Ok(ModelSpec::Transformer(TransformerConfig { sequence_parallel: true, ..config }))
            }
            _ => Err(Error::invalid(
                "sequence parallelism",
                "it splits a transformer's LayerNorm and residual regions along the tokens; this model has none: use \
                 a transformer model or turn sequence parallelism off",
            )),
        }
    }

    /// The per-sample input shape the model takes (`[T]` token ids for a transformer).
    pub fn input_shape(&self) -> Vec<usize> {
        match self {
            ModelSpec::Mlp(dims) => vec![dims[0]],
            ModelSpec::Cnn | ModelSpec::Resnet => vec![1, 8, 8],
            ModelSpec::ResnetImages(side) => vec![1, *side, *side],
            ModelSpec::Transformer(config) => vec![config.tokens],
        }
    }
}

/// Builds layers whole or split over a node's devices, drawing initial values exactly as the
/// unsplit layer would.
struct Splitter<'a> {
    splits: &'a TensorParallelSplits,
    /// This rank's shard, with a rank per tensor-parallel shard.
    here: Option<&'a RankShard>,
    /// The next split Linear is column-parallel (then row, then column, ...).
    column_next: bool,
    /// A transformer's MLP blocks are one node each (the tensor-parallel form).
    mlp_blocks_as_nodes: bool,
}

impl<'a> Splitter<'a> {
    fn new(splits: &'a TensorParallelSplits) -> Self {
        Splitter { splits, here: None, column_next: true, mlp_blocks_as_nodes: false }
    }

    fn group(&self, name: &str) -> Option<&'a [Device]> {
        self.splits.get(name).map(Vec::as_slice).filter(|g| g.len() > 1)
    }

    /// Where the shards of a node split over `group` live: this rank's one when the group holds
    /// this rank's device, every one here otherwise.
    fn shards(&self, group: &[Device]) -> Shards {
        match self.here {
            Some(here) if group.iter().any(|d| d.same_device(here.device())) => Shards::Rank(here.clone()),
            _ => Shards::Local(group.to_vec()),
        }
    }

    /// `Linear(in, out)` with bias; split column-then-row alternately when `name` is split.
    fn linear(
        &mut self,
        name: &str,
        in_features: usize,
        out_features: usize,
        rng: &mut StdRng,
    ) -> Result<Box<dyn Layer>> {
        let linear = Linear::new(in_features, out_features, true, rng)?;
        let Some(group) = self.group(name) else { return Ok(Box::new(linear)) };
        let k = group.len();
        let (column_ok, row_ok) = (out_features >= k, in_features >= k);
        if column_ok && (self.column_next || !row_ok) {
            self.column_next = false;
            Ok(Box::new(ColumnParallelLinear::from_linear_on(&linear, &self.shards(group))?))
        } else if row_ok {
            self.column_next = true;
            Ok(Box::new(RowParallelLinear::from_linear_on(&linear, &self.shards(group))?))
        } else {
            Ok(Box::new(linear))
        }
    }

    /// A model's output layer `Linear(in, classes)` with bias. When `name` is split: column-parallel
    /// if there is a class for every device, computing the softmax cross-entropy over its split
    /// logits without gathering them ([`ColumnParallelLinear::with_split_cross_entropy`]); else
    /// row-parallel.
    fn output_head(
        &mut self,
        name: &str,
        in_features: usize,
        classes: usize,
        rng: &mut StdRng,
    ) -> Result<Box<dyn Layer>> {
        let linear = Linear::new(in_features, classes, true, rng)?;
        match self.group(name) {
            Some(group) if classes >= group.len() => Ok(Box::new(
                ColumnParallelLinear::from_linear_on(&linear, &self.shards(group))?.with_split_cross_entropy(),
            )),
            // Fewer classes than devices: split by the input features instead.
            Some(group) if in_features >= group.len() => {
                Ok(Box::new(RowParallelLinear::from_linear_on(&linear, &self.shards(group))?))
            }
            _ => Ok(Box::new(linear)),
        }
    }

    /// A transformer's MLP block `fc1 → GELU → fc2` (`Linear(dim, hidden)`, `Linear(hidden, dim)`,
    /// drawn in that order) as one [`ParallelMlp`] node: split by the hidden features over the
    /// node's group, or whole on the host (a group of one device) when `name` is not split.
    fn mlp_block(&mut self, name: &str, dim: usize, hidden: usize, rng: &mut StdRng) -> Result<Box<dyn Layer>> {
        let fc1 = Linear::new(dim, hidden, true, rng)?;
        let fc2 = Linear::new(hidden, dim, true, rng)?;
        let shards = match self.group(name) {
            Some(group) => self.shards(group),
            None => Shards::Local(vec![Device::host()]),
        };
        Ok(Box::new(ParallelMlp::from_linears_on(&fc1, MlpActivation::Gelu, &fc2, &shards)?))
    }

    /// A transformer block (`ln1`, `attn`, `ln2`, `fc1`, `fc2`, drawn in the fine graph's order)
    /// as one [`ParallelTransformerBlock`] node: split by heads, hidden features and tokens over
    /// the node's group (sequence parallelism), or whole on the host when `name` is not split.
    fn transformer_block(
        &mut self,
        name: &str,
        dim: usize,
        n_heads: usize,
        rng: &mut StdRng,
    ) -> Result<Box<dyn Layer>> {
        let ln1 = LayerNorm::new(dim)?;
        let attention = MultiheadSelfAttention::new(dim, n_heads, false, rng)?;
        let ln2 = LayerNorm::new(dim)?;
        let fc1 = Linear::new(dim, 4 * dim, true, rng)?;
        let fc2 = Linear::new(4 * dim, dim, true, rng)?;
        let shards = match self.group(name) {
            Some(group) => self.shards(group),
            None => Shards::Local(vec![Device::host()]),
        };
        Ok(Box::new(ParallelTransformerBlock::from_layers_on(&ln1, &attention, &ln2, &fc1, &fc2, &shards)?))
    }

    /// `embedding`, split by vocabulary rows when `name` is split (and the vocabulary has a row
    /// for every device).
    fn embedding(&mut self, name: &str, embedding: Embedding) -> Result<Box<dyn Layer>> {
        match self.group(name) {
            Some(group) if embedding.num_embeddings() >= group.len() => {
                Ok(Box::new(VocabParallelEmbedding::from_embedding_on(&embedding, &self.shards(group))?))
            }
            _ => Ok(Box::new(embedding)),
        }
    }

    /// `MultiheadSelfAttention(dim, heads)`; split by heads when `name` is split (the head count
    /// must be a multiple of the group's size).
    fn attention(&mut self, name: &str, dim: usize, n_heads: usize, rng: &mut StdRng) -> Result<Box<dyn Layer>> {
        let attention = MultiheadSelfAttention::new(dim, n_heads, false, rng)?;
        match self.group(name) {
            Some(group) => Ok(Box::new(ParallelSelfAttention::from_attention_on(&attention, &self.shards(group))?)),
            None => Ok(Box::new(attention)),
        }
    }

    /// `Conv2d(in, out, 3x3, padding 1)`; output channels split when `name` is split.
    fn conv3x3(
        &mut self,
        name: &str,
        in_channels: usize,
        out_channels: usize,
        rng: &mut StdRng,
    ) -> Result<Box<dyn Layer>> {
        let conv = conv3x3(in_channels, out_channels, rng)?;
        match self.group(name) {
            Some(group) if out_channels >= group.len() => Ok(Box::new(ChannelParallelConv2d::from_parameters_on(
                conv.weight(),
                conv.bias(),
                (1, 1),
                (1, 1),
                &self.shards(group),
            )?)),
            _ => Ok(Box::new(conv)),
        }
    }
}

/// `nn.Sequential` of Linear and ReLU layers with PyTorch's child names.
pub fn mlp(dims: &[usize], seed: u64) -> Result<Graph> {
    mlp_with(dims, seed, &mut Splitter::new(&TensorParallelSplits::new()))
}

fn mlp_with(dims: &[usize], seed: u64, split: &mut Splitter<'_>) -> Result<Graph> {
    let mut rng = init::rng(seed);
    let mut g = Graph::new();
    let mut x = g.input("input", [dims[0]])?;
    let mut child = 0;
    for (i, pair) in dims.windows(2).enumerate() {
        let name = child.to_string();
        x = g.add_boxed(&name, split.linear(&name, pair[0], pair[1], &mut rng)?, &[x])?;
        child += 1;
        if i + 2 < dims.len() {
            x = g.add(&child.to_string(), Relu::new(), &[x])?;
            child += 1;
        }
    }
    g.set_output(x)?;
    Ok(g)
}

fn conv3x3(in_channels: usize, out_channels: usize, rng: &mut rand::rngs::StdRng) -> Result<Conv2d> {
    Conv2d::new(in_channels, out_channels, (3, 3), Conv2dOptions { padding: (1, 1), ..Conv2dOptions::default() }, rng)
}

/// LeNet-like for 8x8 digits: conv(1→16) relu → conv(16→32) relu pool → flatten → fc(512→64) relu dropout(0.3) → fc(64→10).
pub fn cnn(seed: u64) -> Result<Graph> {
    cnn_with(seed, &mut Splitter::new(&TensorParallelSplits::new()))
}

fn cnn_with(seed: u64, split: &mut Splitter<'_>) -> Result<Graph> {
    let mut rng = init::rng(seed);
    let mut g = Graph::new();
    let x = g.input("input", [1, 8, 8])?;
    let x = g.add_boxed("conv1", split.conv3x3("conv1", 1, 16, &mut rng)?, &[x])?;
    let x = g.add("relu1", Relu::new(), &[x])?;
    let x = g.add_boxed("conv2", split.conv3x3("conv2", 16, 32, &mut rng)?, &[x])?;
    let x = g.add("relu2", Relu::new(), &[x])?;
    let x = g.add("pool", MaxPool2d::new((2, 2), (2, 2))?, &[x])?;
    let x = g.add("flatten", Flatten::new(), &[x])?;
    let x = g.add_boxed("fc1", split.linear("fc1", 32 * 4 * 4, 64, &mut rng)?, &[x])?;
    let x = g.add("relu3", Relu::new(), &[x])?;
    let x = g.add("dropout", Dropout::new(0.3)?, &[x])?;
    let x = g.add_boxed("fc2", split.linear("fc2", 64, 10, &mut rng)?, &[x])?;
    g.set_output(x)?;
    Ok(g)
}

/// A small residual network: a stem conv, two residual blocks (conv relu conv + skip), pooling
/// and a classifier. The skip connections are graph edges that may cross stages.
pub fn resnet(seed: u64) -> Result<Graph> {
    resnet_with(seed, 8, &mut Splitter::new(&TensorParallelSplits::new()))
}

/// [`resnet`] for `1 x side x side` images (`side` even): the classifier takes `8 x (side/2)²`.
fn resnet_with(seed: u64, side: usize, split: &mut Splitter<'_>) -> Result<Graph> {
    let mut rng = init::rng(seed);
    let mut g = Graph::new();
    let x = g.input("input", [1, side, side])?;
    let stem = g.add_boxed("stem", split.conv3x3("stem", 1, 8, &mut rng)?, &[x])?;
    let mut x = g.add("stem_relu", Relu::new(), &[stem])?;
    for block in 1..=2 {
        let conv1 = format!("block{block}.conv1");
        let a = g.add_boxed(&conv1, split.conv3x3(&conv1, 8, 8, &mut rng)?, &[x])?;
        let a = g.add(&format!("block{block}.relu1"), Relu::new(), &[a])?;
        let conv2 = format!("block{block}.conv2");
        let a = g.add_boxed(&conv2, split.conv3x3(&conv2, 8, 8, &mut rng)?, &[a])?;
        let sum = g.add(&format!("block{block}.add"), Add::new(), &[a, x])?;
        x = g.add(&format!("block{block}.relu2"), Relu::new(), &[sum])?;
    }
    let x = g.add("pool", MaxPool2d::new((2, 2), (2, 2))?, &[x])?;
    let x = g.add("flatten", Flatten::new(), &[x])?;
    let pooled = side / 2;
    let x = g.add_boxed("fc", split.linear("fc", 8 * pooled * pooled, 10, &mut rng)?, &[x])?;
    g.set_output(x)?;
    Ok(g)
}

/// A pre-norm transformer encoder classifier over token ids `[batch, T]` (integer-valued f32 in
/// `0..vocab`), with the node names of this PyTorch module's attributes:
///
/// ```text
/// embed      Embedding(vocab, D)                                  ids [T] -> [T, D]
/// pos        PositionalEmbedding(T, D)   (learned; `pos.weight` [T, D])
/// blocks.i   for i in 0..L:
///   ln1        LayerNorm(D)
///   attn       MultiheadSelfAttention(D, H)  (nn.MultiheadAttention, batch_first, no mask)
///   add1       Add(pos-or-previous-block, attn)                      residual
///   ln2        LayerNorm(D)
///   fc1        Linear(D, 4D)
///   act        GELU (exact)
///   fc2        Linear(4D, D)
///   add2       Add(add1, fc2)                                         residual
/// ln_f       LayerNorm(D)
/// pool       MeanOverTokens                                       [T, D] -> [D]
/// head       Linear(D, C)
/// ```
///
/// so parameters are `embed.weight`, `pos.weight`, `blocks.0.ln1.weight`,
/// `blocks.0.attn.in_proj_weight`, `blocks.0.attn.out_proj.weight`, `blocks.0.fc1.weight`, ...,
/// `head.bias`. The positional table is there because attention and mean pooling are otherwise
/// blind to token order. Parameters are drawn from `seed` in node order with PyTorch's defaults.
pub fn transformer(config: &TransformerConfig, seed: u64) -> Result<Graph> {
    transformer_with(config, seed, &mut Splitter::new(&TensorParallelSplits::new()))
}

/// [`transformer`], or with `split.mlp_blocks_as_nodes` its tensor-parallel form (see
/// [`ModelSpec::build_split`]) with its split nodes built split: the token embedding by
/// vocabulary rows, each block's attention by heads, its MLP block (`fc1`, GELU, `fc2` as the one
/// node `blocks.i`) by the hidden features, and `head` column-parallel with the loss over its
/// split logits (vocabulary-parallel cross-entropy; the embedding and the head stay whole when
/// tied). The positional table and the LayerNorms stay whole on the stage's
/// first device.
fn transformer_with(config: &TransformerConfig, seed: u64, split: &mut Splitter<'_>) -> Result<Graph> {
    let &TransformerConfig { vocab, tokens, dim, n_heads, n_layers, classes, tied, sequence_parallel } = config;
    if tied && classes != vocab {
        return Err(Error::invalid(
            "transformer",
            format!("tied embeddings need classes = vocab; got {classes} classes, vocab {vocab}"),
        ));
    }
    let mut rng = init::rng(seed);
    let mut g = Graph::new();
    let ids = g.input("input", [tokens])?;
    // A tied embedding stays whole: the head that shares its weight is whole.
    let embed = Embedding::new(vocab, dim, &mut rng)?;
    let embed = match tied {
        true => Box::new(embed),
        false => split.embedding("embed", embed)?,
    };
    let x = g.add_boxed("embed", embed, &[ids])?;
    let mut x = g.add("pos", PositionalEmbedding::new(tokens, dim, &mut rng)?, &[x])?;
    for block in 0..n_layers {
        let name = |part: &str| format!("blocks.{block}.{part}");
        if sequence_parallel && split.mlp_blocks_as_nodes {
            // The node `blocks.{block}`: its parameters are `blocks.{block}.ln1.weight` ...
            let node = format!("blocks.{block}");
            x = g.add_boxed(&node, split.transformer_block(&node, dim, n_heads, &mut rng)?, &[x])?;
            continue;
        }
        let h = g.add(&name("ln1"), LayerNorm::new(dim)?, &[x])?;
        let h = g.add_boxed(&name("attn"), split.attention(&name("attn"), dim, n_heads, &mut rng)?, &[h])?;
        let sum = g.add(&name("add1"), Add::new(), &[x, h])?;
        let h = g.add(&name("ln2"), LayerNorm::new(dim)?, &[sum])?;
        let h = if split.mlp_blocks_as_nodes {
            // The node `blocks.{block}`: its parameters are `blocks.{block}.fc1.weight` ...
            let mlp_node = format!("blocks.{block}");
            g.add_boxed(&mlp_node, split.mlp_block(&mlp_node, dim, 4 * dim, &mut rng)?, &[h])?
        } else {
            let fc1 = Linear::new(dim, 4 * dim, true, &mut rng)?;
            let fc2 = Linear::new(4 * dim, dim, true, &mut rng)?;
            let h = g.add(&name("fc1"), fc1, &[h])?;
            let h = g.add(&name("act"), Gelu::new(), &[h])?;
            g.add(&name("fc2"), fc2, &[h])?
        };
        x = g.add(&name("add2"), Add::new(), &[sum, h])?;
    }
    let x = g.add("ln_f", LayerNorm::new(dim)?, &[x])?;
    let x = g.add("pool", MeanOverTokens::new(), &[x])?;
    // A tied head stays whole: its weight is the embedding's, which is not split.
    let head = match tied {
        true => Box::new(Linear::new(dim, classes, true, &mut rng)?),
        false => split.output_head("head", dim, classes, &mut rng)?,
    };
    let x = g.add_boxed("head", head, &[x])?;
    g.set_output(x)?;
    if tied {
        g.tie(&["embed.weight", "head.weight"]);
    }
    Ok(g)
}
