//! The actors: one file each, with its messages beside its handlers.

pub(crate) mod lease_keeper;
pub(crate) mod run;
pub(crate) mod store;
pub(crate) mod supervisor;
