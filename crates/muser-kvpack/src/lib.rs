//! muser-kvpack
