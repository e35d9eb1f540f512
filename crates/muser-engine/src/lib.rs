//! muser-engine
