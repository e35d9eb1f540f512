//! Numerics profiles: which reproducible floating-point order the CPU backend computes in.
//!
//! ggml's CPU kernels round differently per instruction set (the lanes of a dot product, the
//! vector `expf` of the softmax, flash attention's f16 paths), so "equal to llama.cpp" names a
//! build: llama.cpp b11434 for one x86 instruction set, with flash attention on or off. An
//! [`Order`] is one such build; a [`Numerics`] is an order plus the flash-attention choice.
//! Whatever order is chosen, every kernel family (AVX512, AVX2, scalar) computes it bit for
//! bit: the order is a property of the arithmetic, not of the machine that runs it.
//!
//! - `portable` ([`NumericsMode::Portable`]) is one order on every x86 host (ggml's AVX512
//!   build, flash attention on): two Muser nodes with the same profile give the same tokens,
//!   which the disaggregated lane and kvpack rely on.
//! - `host` ([`NumericsMode::Host`]) is the order of llama.cpp built natively for the running
//!   CPU with its default settings: the AVX512 order on an AVX512 host, the AVX2 order on an
//!   AVX2-only host.
//!
//! The CPU backend computes both orders with flash attention on and off (`docs/exactness.md`).
//! The profile travels with the backend ([`crate::cpu::CpuBackend::with_numerics`]) down to the
//! kernels that depend on it.

use crate::error::ModelError;
use muser_quant::Isa;

/// Which profile the user asks for (`--numerics`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NumericsMode {
    /// The same order on every x86 host (ggml's AVX512 build).
    #[default]
    Portable,
    /// llama.cpp b11434 as built natively for this CPU, default settings.
    Host,
}

/// Flash attention, in llama.cpp's spelling (`--flash-attn on|off|auto`); `auto` is on for the
/// CPU backend, as llama.cpp resolves it there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FlashAttn {
    On,
    Off,
    #[default]
    Auto,
}

/// A floating-point order: the ggml CPU build whose kernels it reproduces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// llama.cpp b11434 built with AVX512 (F/BW/VL/VNNI/BF16) on x86-64.
    GgmlAvx512,
    /// llama.cpp b11434 built with AVX2/FMA/F16C and without AVX512 on x86-64.
    GgmlAvx2,
}

impl Order {
    /// Every order, for tests and listings.
    pub const ALL: [Order; 2] = [Order::GgmlAvx512, Order::GgmlAvx2];

    /// The order named `name` ([`Order::name`]).
    pub fn from_name(name: &str) -> Option<Order> {
        Order::ALL.into_iter().find(|o| o.name() == name)
    }

    /// The order's name in tags and messages.
    pub fn name(self) -> &'static str {
        match self {
            Order::GgmlAvx512 => "x86-avx512",
            Order::GgmlAvx2 => "x86-avx2",
        }
    }

    /// f32 lanes of the build's vector registers: the width of its softmax groups, tinyBLAS
    /// accumulators and `ggml_vec_dot_f16`/`_f32` accumulators.
    pub fn lanes(self) -> usize {
        match self {
            Order::GgmlAvx512 => 16,
            Order::GgmlAvx2 => 8,
        }
    }
}

/// A resolved numerics profile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Numerics {
    pub order: Order,
    pub flash_attn: bool,
}

impl Default for Numerics {
    fn default() -> Numerics {
        Numerics::PORTABLE
    }
}

impl Numerics {
    /// The order the CPU backend computes on every host by default: ggml's AVX512 build with
    /// flash attention.
    pub const PORTABLE: Numerics = Numerics {
        order: Order::GgmlAvx512,
        flash_attn: true,
    };

    /// The profile `mode` and `fa` name on a host whose best kernel family is `isa`
    /// ([`muser_quant::detected_isa`], so `MUSER_ISA=avx2` resolves as an AVX2 host would).
    /// Refused when `host` has no meaning (a CPU without AVX2, for which llama.cpp's build is
    /// yet another order).
    pub fn resolve(mode: NumericsMode, fa: FlashAttn, isa: Isa) -> Result<Numerics, ModelError> {
        let order = match (mode, isa) {
            (NumericsMode::Portable, _) | (NumericsMode::Host, Isa::Avx512) => Order::GgmlAvx512,
            (NumericsMode::Host, Isa::Avx2) => Order::GgmlAvx2,
            (NumericsMode::Host, Isa::Scalar) => {
                return Err(ModelError::Numerics(
                    "--numerics host: this CPU has no AVX2, and llama.cpp's build for it is an \
                     order Muser does not reproduce; use --numerics portable"
                        .into(),
                ))
            }
        };
        Ok(Numerics {
            order,
            flash_attn: fa != FlashAttn::Off,
        })
    }

    /// The profile's identity, for kvpack's `engine_abi` and for receipts:
    /// `ggml-b11434/<order>/fa-on|fa-off`.
    pub fn tag(&self) -> String {
        format!(
            "ggml-b11434/{}/fa-{}",
            self.order.name(),
            if self.flash_attn { "on" } else { "off" }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_resolve_per_host() {
        use FlashAttn::*;
        use NumericsMode::*;
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512] {
            for fa in [On, Auto] {
                assert_eq!(
                    Numerics::resolve(Portable, fa, isa).unwrap(),
                    Numerics::PORTABLE
                );
            }
            let off = Numerics::resolve(Portable, Off, isa).unwrap();
            assert_eq!(off.tag(), "ggml-b11434/x86-avx512/fa-off");
        }
        assert_eq!(
            Numerics::resolve(Host, Auto, Isa::Avx512).unwrap(),
            Numerics::PORTABLE
        );
        let avx2 = Numerics::resolve(Host, Auto, Isa::Avx2).unwrap();
        assert_eq!(avx2.tag(), "ggml-b11434/x86-avx2/fa-on");
        assert_ne!(avx2.tag(), Numerics::PORTABLE.tag());
        let off = Numerics::resolve(Host, Off, Isa::Avx2).unwrap();
        assert_eq!(off.tag(), "ggml-b11434/x86-avx2/fa-off");
        let none = Numerics::resolve(Host, On, Isa::Scalar)
            .unwrap_err()
            .to_string();
        assert!(none.contains("no AVX2"), "{none}");
        assert_eq!(Numerics::PORTABLE.tag(), "ggml-b11434/x86-avx512/fa-on");
    }
}
