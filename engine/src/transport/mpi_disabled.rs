//! The MPI transport in a build without the `mpi` feature: the same names, an uninhabited type,
//! and an error that says how to build with MPI, so callers compile either way.
use std::sync::Arc;
use std::time::Duration;

use crossbeam::channel::Receiver;

use super::{LinkCost, Tag, Transport, TransportKind};
use crate::{Error, Result};

/// Whether this build can run on MPI.
pub const MPI_BUILT: bool = false;

/// The MPI transport; this build has none (see [`MpiTransport::init`]).
#[derive(Debug)]
pub enum MpiTransport {}

impl MpiTransport {
    /// Always [`Error::MpiNotBuilt`]: this build has no MPI support.
    pub fn init() -> Result<Arc<MpiTransport>> {
        Err(Error::MpiNotBuilt)
    }
}

impl Transport for MpiTransport {
    fn rank(&self) -> usize {
        match *self {}
    }
    fn world_size(&self) -> usize {
        match *self {}
    }
    fn kind(&self) -> TransportKind {
        match *self {}
    }
    fn send(&self, _to: usize, _tag: Tag, _bytes: Vec<u8>) -> Result<()> {
        match *self {}
    }
    fn inbox(&self, _tag: Tag) -> Result<Receiver<Vec<u8>>> {
        match *self {}
    }
    fn close_rounds_before(&self, _round: u64) {
        match *self {}
    }
    fn all_gather(&self, _bytes: Vec<u8>, _timeout: Duration) -> Result<Vec<Vec<u8>>> {
        match *self {}
    }
    fn link(&self, _peer: usize) -> Option<LinkCost> {
        match *self {}
    }
    fn clock_offset_s(&self) -> f64 {
        match *self {}
    }
    fn abort(&self, _code: i32) -> ! {
        match *self {}
    }
}
