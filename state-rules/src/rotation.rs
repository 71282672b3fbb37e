//! Where a key's record lives while its key secret is rotated: the key has an address under the
//! current secret and one under the previous secret, and at most one record.

/// One of a key's two addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Address {
    Current,
    Previous,
}

/// Which record a claim reads, in the same statement as its insert: the one at the current
/// address, else the one at the previous address. `None`: there is none, and the claim inserts
/// at the current address (never at the previous one), so a record under the previous secret
/// deleted meanwhile cannot let two claims be granted, one under each secret.
pub fn claim_reads(at_current: bool, at_previous: bool) -> Option<Address> {
    if at_current {
        Some(Address::Current)
    } else if at_previous {
        Some(Address::Previous)
    } else {
        None
    }
}

/// Where a write leaves the record it found at `at`: moved to the current address (a record
/// written again under the new secret, so that dropping the previous secret orphans no live
/// record), unless a record is there already. (A complete moves the record first, then seals
/// its response under the address it is stored at.)
pub fn written_to(at: Address, current_taken: bool) -> Address {
    if current_taken || crate::undo::undone(crate::undo::Fix::RotationMove) {
        at
    } else {
        Address::Current
    }
}
