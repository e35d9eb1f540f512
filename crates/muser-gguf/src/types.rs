//! The ggml tensor types: ids as in `ggml/include/ggml.h` of llama.cpp b11434, names, block
//! sizes (values per block) and type sizes (bytes per block) as in ggml's type-traits table.

/// A ggml tensor element type. Ids that ggml has retired (4, 5, 31-33, 36-38) have no variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
    Q1_0,
    Q2_0,
}

const QK_K: usize = 256;

/// (type, id, name, values per block, bytes per block, quantized)
const TABLE: [(GgmlType, u32, &str, usize, usize, bool); 35] = {
    use GgmlType::*;
    [
        (F32, 0, "f32", 1, 4, false),
        (F16, 1, "f16", 1, 2, false),
        (Q4_0, 2, "q4_0", 32, 2 + 16, true),
        (Q4_1, 3, "q4_1", 32, 2 + 2 + 16, true),
        (Q5_0, 6, "q5_0", 32, 2 + 4 + 16, true),
        (Q5_1, 7, "q5_1", 32, 2 + 2 + 4 + 16, true),
        (Q8_0, 8, "q8_0", 32, 2 + 32, true),
        (Q8_1, 9, "q8_1", 32, 2 + 2 + 32, true),
        (Q2_K, 10, "q2_K", QK_K, 2 + 2 + QK_K / 16 + QK_K / 4, true),
        (Q3_K, 11, "q3_K", QK_K, 2 + QK_K / 4 + QK_K / 8 + 12, true),
        (Q4_K, 12, "q4_K", QK_K, 2 + 2 + QK_K / 2 + 12, true),
        (
            Q5_K,
            13,
            "q5_K",
            QK_K,
            2 + 2 + QK_K / 2 + QK_K / 8 + 12,
            true,
        ),
        (
            Q6_K,
            14,
            "q6_K",
            QK_K,
            2 + QK_K / 2 + QK_K / 4 + QK_K / 16,
            true,
        ),
        (Q8_K, 15, "q8_K", QK_K, 4 + QK_K + QK_K / 8, true),
        (IQ2_XXS, 16, "iq2_xxs", QK_K, 2 + QK_K / 4, true),
        (IQ2_XS, 17, "iq2_xs", QK_K, 2 + QK_K / 4 + QK_K / 32, true),
        (IQ3_XXS, 18, "iq3_xxs", QK_K, 2 + QK_K / 4 + QK_K / 8, true),
        (IQ1_S, 19, "iq1_s", QK_K, 2 + QK_K / 8 + QK_K / 16, true),
        (IQ4_NL, 20, "iq4_nl", 32, 2 + 16, true),
        (
            IQ3_S,
            21,
            "iq3_s",
            QK_K,
            2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4,
            true,
        ),
        (IQ2_S, 22, "iq2_s", QK_K, 2 + QK_K / 4 + QK_K / 16, true),
        (
            IQ4_XS,
            23,
            "iq4_xs",
            QK_K,
            2 + 2 + QK_K / 2 + QK_K / 64,
            true,
        ),
        (I8, 24, "i8", 1, 1, false),
        (I16, 25, "i16", 1, 2, false),
        (I32, 26, "i32", 1, 4, false),
        (I64, 27, "i64", 1, 8, false),
        (F64, 28, "f64", 1, 8, false),
        (
            IQ1_M,
            29,
            "iq1_m",
            QK_K,
            QK_K / 8 + QK_K / 16 + QK_K / 32,
            true,
        ),
        (BF16, 30, "bf16", 1, 2, false),
        (TQ1_0, 34, "tq1_0", QK_K, 2 + 4 * 13, true),
        (TQ2_0, 35, "tq2_0", QK_K, 2 + 64, true),
        (MXFP4, 39, "mxfp4", 32, 1 + 16, true),
        (NVFP4, 40, "nvfp4", 64, 4 + 32, true),
        (Q1_0, 41, "q1_0", 128, 2 + 16, true),
        (Q2_0, 42, "q2_0", 64, 2 + 16, true),
    ]
};

impl GgmlType {
    /// Every type, in id order.
    pub const ALL: [GgmlType; 35] = {
        let mut all = [GgmlType::F32; 35];
        let mut i = 0;
        while i < TABLE.len() {
            all[i] = TABLE[i].0;
            i += 1;
        }
        all
    };

    fn row(self) -> &'static (GgmlType, u32, &'static str, usize, usize, bool) {
        // The table is in declaration order, so the discriminant is the index.
        &TABLE[self as usize]
    }

    /// The numeric id stored in GGUF tensor infos (`enum ggml_type`).
    pub fn id(self) -> u32 {
        self.row().1
    }

    /// The type with this id, or `None` for ids ggml does not define (or has retired).
    pub fn from_id(id: u32) -> Option<Self> {
        TABLE.iter().find(|r| r.1 == id).map(|r| r.0)
    }

    /// ggml's name for the type: "f32", "q8_0", "q4_K", "nvfp4", ...
    pub fn name(self) -> &'static str {
        self.row().2
    }

    /// The type whose ggml name is `name`, compared case-insensitively ("q4_k" finds Q4_K).
    pub fn from_name(name: &str) -> Option<Self> {
        TABLE
            .iter()
            .find(|r| r.2.eq_ignore_ascii_case(name))
            .map(|r| r.0)
    }

    /// Values per block (1 for plain types).
    pub fn block_size(self) -> usize {
        self.row().3
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.row().4
    }

    /// Whether ggml marks the type as quantized (block formats; not f32/f16/bf16/integers).
    pub fn is_quantized(self) -> bool {
        self.row().5
    }

    /// Bytes of a row of `n_elems` values, or `None` if `n_elems` is not a whole number of
    /// blocks or the size overflows.
    pub fn row_bytes(self, n_elems: usize) -> Option<usize> {
        if !n_elems.is_multiple_of(self.block_size()) {
            return None;
        }
        (n_elems / self.block_size()).checked_mul(self.type_size())
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_in_declaration_order_and_ids_are_unique() {
        for (i, row) in TABLE.iter().enumerate() {
            assert_eq!(row.0 as usize, i, "{}", row.2);
            assert_eq!(GgmlType::from_id(row.1), Some(row.0));
            assert_eq!(GgmlType::from_name(row.2), Some(row.0));
        }
    }

    #[test]
    fn ids_and_sizes_match_ggml() {
        use GgmlType::*;
        let expect = [
            (F32, 0, 1, 4),
            (F16, 1, 1, 2),
            (Q4_0, 2, 32, 18),
            (Q4_1, 3, 32, 20),
            (Q5_0, 6, 32, 22),
            (Q8_0, 8, 32, 34),
            (Q4_K, 12, 256, 144),
            (Q5_K, 13, 256, 176),
            (Q6_K, 14, 256, 210),
            (Q8_K, 15, 256, 292),
            (BF16, 30, 1, 2),
            (MXFP4, 39, 32, 17),
            (NVFP4, 40, 64, 36),
        ];
        for (ty, id, block, size) in expect {
            assert_eq!(
                (ty.id(), ty.block_size(), ty.type_size()),
                (id, block, size),
                "{ty}"
            );
        }
        for retired in [4, 5, 31, 32, 33, 36, 37, 38, 43] {
            assert_eq!(GgmlType::from_id(retired), None);
        }
        assert_eq!(Q4_K.name(), "q4_K");
        assert_eq!(Q4_K.row_bytes(512), Some(288));
        assert_eq!(Q4_K.row_bytes(100), None);
        assert!(Q4_K.is_quantized() && !BF16.is_quantized());
    }
}
