//! Reading `meta` records and the applied lock state in the `state` tree, checksums verified.

use super::SledStorage;
use crate::storage::codec::{decode_state_value, state_key_name};
use crate::storage::{KvPair, StorageError};

impl SledStorage {
    pub(super) fn get_meta(&self, key: &[u8]) -> Result<Option<sled::IVec>, StorageError> {
        self.meta
            .get(key)
            .map_err(|e| StorageError::sled("reading meta", e))
    }

    /// The applied state in key order, checksums verified.
    pub(super) fn read_state(&self) -> Result<Vec<KvPair>, StorageError> {
        read_state(&self.state)
    }
}

/// The applied state in `state` in key order, checksums verified.
fn read_state(state: &sled::Tree) -> Result<Vec<KvPair>, StorageError> {
    state_pairs(state).collect()
}

/// The applied state in `state` in key order, one pair at a time, checksums verified.
pub(super) fn state_pairs(
    state: &sled::Tree,
) -> impl Iterator<Item = Result<KvPair, StorageError>> + '_ {
    state.iter().map(|item| {
        let (k, v) = item.map_err(|e| StorageError::sled("reading the state", e))?;
        let value = decode_state_value(&v).map_err(|e| e.at("state", state_key_name(&k)))?;
        Ok((k.to_vec(), value.to_vec()))
    })
}
