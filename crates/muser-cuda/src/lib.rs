//! muser-cuda
