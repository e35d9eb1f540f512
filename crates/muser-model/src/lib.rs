//! muser-model
