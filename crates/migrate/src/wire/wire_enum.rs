//! `wire_enum!`: how the wire's enums are declared, so that each one's decoder is derived from
//! the same list of variants as its encoding (`as u16`) and a variant added is a value decoded.

#![forbid(unsafe_code)]

/// Declares a fieldless enum over an integer type (`pub enum Kind: u16 { .. }` becomes
/// `#[repr(u16)] pub enum Kind { .. }`) and its decoder, `TryFrom<u16>`: the variant with that
/// value, or the value back as the error when no variant has it. What an unknown value means
/// (an `Invalid`, a refusal not known to this version) is the caller's to say.
///
/// `ferry_guest_abi`'s `report_enum!` is its twin for the guest's reports: neither crate depends
/// on the other, and a derive crate (num_enum) would be a proc macro built with the guest
/// kernel's flags, which no host shared object links with.
macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident: $repr:ident {
            $( $(#[$variant_meta:meta])* $variant:ident = $value:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[repr($repr)]
        $vis enum $name {
            $( $(#[$variant_meta])* $variant = $value, )+
        }

        impl TryFrom<$repr> for $name {
            type Error = $repr;

            fn try_from(value: $repr) -> Result<Self, $repr> {
                match value {
                    $( $value => Ok($name::$variant), )+
                    unknown => Err(unknown),
                }
            }
        }
    };
}

pub(super) use wire_enum;
