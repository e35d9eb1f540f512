//! muser-server
