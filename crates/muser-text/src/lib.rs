//! muser-text
