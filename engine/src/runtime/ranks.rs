//! What the runtime's ranks exchange, and in which byte format: a message between stages on two
//! ranks, each rank's vote on a step's commit, each rank's end of a step (its timeline, memory
//! peaks, outputs and whether its update failed), and named tensors (parameters and optimizer
//! state gathered for a checkpoint). The protocol that uses them is in `coordinator.rs`;
//! `transport/README.md` argues it.
use conveyor_schedules::{OpKind, TimelineEvent};

use super::OpCpuTime;
use super::stage::Payload;
use super::worker::Message;
use crate::graph::NodeId;
use crate::transport::wire::{Reader, Writer};
use crate::{Device, Error, Result, Shape, Tensor};

/// One micro-batch's tensors for a stage on another rank.
pub(crate) fn encode_message(micro_batch_idx: usize, payload: &Payload) -> Result<Vec<u8>> {
    let mut w = Writer::default();
    w.usize(micro_batch_idx).usize(payload.len());
    for (node, tensor) in payload {
        w.usize(node.index());
        w.tensor(tensor)?;
    }
    Ok(w.bytes)
}

/// A message from another rank, its tensors created on `device` (the receiving stage's).
pub(crate) fn decode_message(bytes: &[u8], device: &Device) -> Result<Message> {
    let mut r = Reader::new(bytes);
    let micro_batch_idx = r.usize()?;
    let n = r.count(16)?;
    let payload = (0..n)
        .map(|_| Ok((NodeId(petgraph::graph::NodeIndex::new(r.usize()?)), r.tensor(device)?)))
        .collect::<Result<Payload>>()?;
    Ok((micro_batch_idx, payload))
}

/// A rank's vote on a step's commit.
#[derive(Debug)]
pub(super) enum Vote {
    /// Every local backward is done and the update prepared.
    Ready {
        /// Losses of the micro-batches whose output is on this rank.
        losses: Vec<(usize, f64)>,
        /// Per local pipeline device: its gradients' sum of squares.
        sums_of_squares: Vec<(usize, f64)>,
        /// The first local stage and parameter with a non-finite gradient.
        non_finite: Option<(usize, String)>,
    },
    /// A local op failed: the error's message.
    Failed { message: String },
    /// Aborted because another rank failed.
    Aborted,
}

impl Vote {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        match self {
            Vote::Ready { losses, sums_of_squares, non_finite } => {
                w.u8(0).usize(losses.len());
                for &(mb, l) in losses {
                    w.usize(mb).f64(l);
                }
                w.usize(sums_of_squares.len());
                for &(d, s) in sums_of_squares {
                    w.usize(d).f64(s);
                }
                match non_finite {
                    Some((stage, parameter)) => w.u8(1).usize(*stage).str(parameter),
                    None => w.u8(0),
                };
            }
            Vote::Failed { message } => {
                w.u8(1).str(message);
            }
            Vote::Aborted => {
                w.u8(2);
            }
        }
        w.bytes
    }

    pub(super) fn decode(bytes: &[u8]) -> Result<Vote> {
        let mut r = Reader::new(bytes);
        Ok(match r.u8()? {
            0 => {
                let n = r.count(16)?;
                let losses = (0..n).map(|_| Ok((r.usize()?, r.f64()?))).collect::<Result<_>>()?;
                let n = r.count(16)?;
                let sums_of_squares = (0..n).map(|_| Ok((r.usize()?, r.f64()?))).collect::<Result<_>>()?;
                let non_finite = match r.u8()? {
                    0 => None,
                    _ => Some((r.usize()?, r.string()?)),
                };
                Vote::Ready { losses, sums_of_squares, non_finite }
            }
            1 => Vote::Failed { message: r.string()? },
            _ => Vote::Aborted,
        })
    }
}

/// A rank's end of a step, gathered by every rank so each reports the whole step.
#[derive(Default)]
pub(super) struct Finish {
    /// The first local failure after the vote (or in an evaluation), as text.
    pub failure: Option<String>,
    /// When the step started on this rank, in seconds on rank 0's clock.
    pub started_s: f64,
    pub events: Vec<TimelineEvent>,
    pub cpu_times: Vec<OpCpuTime>,
    /// Per local stage: its peak activation bytes.
    pub peak_activation_bytes: Vec<(usize, u64)>,
    /// Per local device (index into the trainer's devices): its peak bytes.
    pub peak_memory: Vec<(usize, u64)>,
    /// Per micro-batch whose output is on this rank (evaluation): the output.
    pub outputs: Vec<(usize, Tensor)>,
}

/// Every op kind, in the order of its wire code.
const OPS: [OpKind; 11] = [
    OpKind::Forward,
    OpKind::BackwardInput,
    OpKind::BackwardWeight,
    OpKind::Backward,
    OpKind::OptimizerStep,
    OpKind::Send,
    OpKind::Recv,
    OpKind::Wait,
    OpKind::CoreWait,
    OpKind::Recompute,
    OpKind::AllReduce,
];

fn op_code(op: OpKind) -> u8 {
    OPS.iter().position(|&o| o == op).unwrap_or(0) as u8
}

fn op_of(code: u8) -> Result<OpKind> {
    OPS.get(code as usize)
        .copied()
        .ok_or_else(|| Error::invalid("transport message", format!("unknown op code {code} from another rank")))
}

impl Finish {
    pub(super) fn encode(&self) -> Result<Vec<u8>> {
        let mut w = Writer::default();
        match &self.failure {
            Some(message) => w.u8(1).str(message),
            None => w.u8(0),
        };
        w.f64(self.started_s);
        w.usize(self.events.len());
        for e in &self.events {
            w.usize(e.device_idx).opt_usize(e.stage_idx).u8(op_code(e.op)).opt_usize(e.micro_batch_idx);
            w.f64(e.start_s).f64(e.end_s);
        }
        w.usize(self.cpu_times.len());
        for c in &self.cpu_times {
            w.usize(c.device_idx).opt_usize(c.stage_idx).u8(op_code(c.op)).opt_usize(c.micro_batch_idx).f64(c.cpu_s);
        }
        for list in [&self.peak_activation_bytes, &self.peak_memory] {
            w.usize(list.len());
            for &(i, b) in list {
                w.usize(i).u64(b);
            }
        }
        w.usize(self.outputs.len());
        for (mb, t) in &self.outputs {
            w.usize(*mb);
            w.tensor(t)?;
        }
        Ok(w.bytes)
    }

    pub(super) fn decode(bytes: &[u8]) -> Result<Finish> {
        let mut r = Reader::new(bytes);
        let failure = match r.u8()? {
            0 => None,
            _ => Some(r.string()?),
        };
        let started_s = r.f64()?;
        let n = r.count(41)?;
        let events = (0..n)
            .map(|_| {
                Ok(TimelineEvent {
                    device_idx: r.usize()?,
                    stage_idx: r.opt_usize()?,
                    op: op_of(r.u8()?)?,
                    micro_batch_idx: r.opt_usize()?,
                    start_s: r.f64()?,
                    end_s: r.f64()?,
                })
            })
            .collect::<Result<_>>()?;
        let n = r.count(33)?;
        let cpu_times = (0..n)
            .map(|_| {
                Ok(OpCpuTime {
                    device_idx: r.usize()?,
                    stage_idx: r.opt_usize()?,
                    op: op_of(r.u8()?)?,
                    micro_batch_idx: r.opt_usize()?,
                    cpu_s: r.f64()?,
                })
            })
            .collect::<Result<_>>()?;
        let mut pairs = || -> Result<Vec<(usize, u64)>> {
            let n = r.count(16)?;
            (0..n).map(|_| Ok((r.usize()?, r.u64()?))).collect()
        };
        let peak_activation_bytes = pairs()?;
        let peak_memory = pairs()?;
        let n = r.count(8)?;
        let host = Device::host();
        let outputs = (0..n).map(|_| Ok((r.usize()?, r.tensor(&host)?))).collect::<Result<_>>()?;
        Ok(Finish { failure, started_s, events, cpu_times, peak_activation_bytes, peak_memory, outputs })
    }
}

/// Named tensors (parameters or optimizer state) for a gather.
pub(super) fn encode_named(tensors: &[(String, Tensor)]) -> Result<Vec<u8>> {
    let mut w = Writer::default();
    w.usize(tensors.len());
    for (name, t) in tensors {
        w.str(name);
        w.tensor(t)?;
    }
    Ok(w.bytes)
}

/// Named tensors from another rank, on the host.
pub(super) fn decode_named(bytes: &[u8]) -> Result<Vec<(String, Tensor)>> {
    let mut r = Reader::new(bytes);
    let n = r.count(8)?;
    let host = Device::host();
    (0..n).map(|_| Ok((r.string()?, r.tensor(&host)?))).collect()
}

/// Named shapes (a checkpoint's expected tensors) for a gather.
pub(super) fn encode_shapes(shapes: &[(String, Shape)]) -> Vec<u8> {
    let mut w = Writer::default();
    w.usize(shapes.len());
    for (name, shape) in shapes {
        w.str(name).usize(shape.dims().len());
        for &d in shape.dims() {
            w.usize(d);
        }
    }
    w.bytes
}

/// Named shapes from another rank.
pub(super) fn decode_shapes(bytes: &[u8]) -> Result<Vec<(String, Shape)>> {
    let mut r = Reader::new(bytes);
    (0..r.count(16)?)
        .map(|_| {
            let name = r.string()?;
            let dims = (0..r.count(8)?).map(|_| r.usize()).collect::<Result<Vec<_>>>()?;
            Ok((name, Shape::new(dims)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn votes_finishes_and_messages_round_trip() {
        let vote = Vote::Ready {
            losses: vec![(1, 0.5), (0, f64::NAN)],
            sums_of_squares: vec![(1, 2.0)],
            non_finite: Some((3, "fc.weight".into())),
        };
        let back = Vote::decode(&vote.encode()).unwrap();
        let Vote::Ready { losses, sums_of_squares, non_finite } = back else { panic!("not ready: {back:?}") };
        assert_eq!(losses[0], (1, 0.5));
        assert!(losses[1].1.is_nan());
        assert_eq!(sums_of_squares, [(1, 2.0)]);
        assert_eq!(non_finite, Some((3, "fc.weight".to_string())));
        assert!(matches!(Vote::decode(&Vote::Failed { message: "x".into() }.encode()).unwrap(), Vote::Failed { .. }));

        let host = Device::host();
        let t = Tensor::from_vec(vec![1.0, 2.0], [1, 2], &host).unwrap();
        let finish = Finish {
            failure: Some("boom".into()),
            started_s: 12.5,
            events: vec![TimelineEvent {
                device_idx: 1,
                stage_idx: Some(1),
                op: OpKind::BackwardWeight,
                micro_batch_idx: None,
                start_s: 0.25,
                end_s: 0.5,
            }],
            cpu_times: vec![],
            peak_activation_bytes: vec![(1, 99)],
            peak_memory: vec![(2, 1234)],
            outputs: vec![(3, t.share())],
        };
        let back = Finish::decode(&finish.encode().unwrap()).unwrap();
        assert_eq!(back.failure.as_deref(), Some("boom"));
        assert_eq!(back.events, finish.events);
        assert_eq!(back.peak_memory, [(2, 1234)]);
        assert!(back.outputs[0].1.bit_eq(&t));

        let payload: Payload = vec![(NodeId(petgraph::graph::NodeIndex::new(4)), t.share())];
        let (mb, got) = decode_message(&encode_message(7, &payload).unwrap(), &host).unwrap();
        assert_eq!((mb, got[0].0), (7, NodeId(petgraph::graph::NodeIndex::new(4))));
        assert!(got[0].1.bit_eq(&t));
        let named = decode_named(&encode_named(&[("a.weight".into(), t.share())]).unwrap()).unwrap();
        assert_eq!(named[0].0, "a.weight");
        let shapes =
            vec![("a.weight".to_string(), Shape::new(vec![3, 2])), ("a.bias".to_string(), Shape::new(vec![3]))];
        assert_eq!(decode_shapes(&encode_shapes(&shapes)).unwrap(), shapes);
    }
}
