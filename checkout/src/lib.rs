//! The demo checkout. (Being built: see issue 4.)
