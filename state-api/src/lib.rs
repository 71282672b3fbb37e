//! The state API. (Being built: see issue 2.)
