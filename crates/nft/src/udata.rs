//! nft's set user data (`NFTA_SET_USERDATA`): the byte order of keys and values and, for `typeof`
//! declarations, the expressions a set was declared with. The kernel stores it without reading it; `nft list`
//! reads it to print keys and to type-check the rules that use the set when a listing is loaded again. A map
//! keyed by a numgen slot has no nft type name of its own, so without this data its listing does not reload.
//!
//! The layout is libnftnl's TLV (type: u8, length: u8, value; values of u32 in host byte order, nests as
//! values), written exactly as nft 1.0.6 (the distribution's) writes it, which newer nft reads as well.

use super::ir::{DataType, MetaKey, Set};

/// An expression a set is declared with (`typeof ip daddr . th dport`): the shapes nftkube declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TypeofExpr {
    /// `ip saddr`.
    IpSaddr,
    /// `ip daddr`.
    IpDaddr,
    /// `ip6 saddr`.
    Ip6Saddr,
    /// `ip6 daddr`.
    Ip6Daddr,
    /// `th dport`.
    ThDport,
    /// `meta l4proto`.
    MetaL4proto,
    /// `numgen random mod N offset O`.
    NumgenRandom {
        /// N.
        modulus: u32,
        /// O.
        offset: u32,
    },
}

// nftnl_udata_set_types.
const KEY_BYTEORDER: u8 = 0;
const DATA_BYTEORDER: u8 = 1;
const KEY_TYPEOF: u8 = 3;
const DATA_TYPEOF: u8 = 4;
const DATA_INTERVAL: u8 = 6;
// In a typeof description: the expression type, then its own data.
const TYPEOF_EXPR: u8 = 0;
const TYPEOF_DATA: u8 = 1;
// nft's `enum expr_types`.
const EXPR_PAYLOAD: u32 = 7;
const EXPR_META: u32 = 9;
const EXPR_CONCAT: u32 = 13;
const EXPR_NUMGEN: u32 = 23;
// nft's `enum proto_desc_id` and header field numbers.
const DESC_TH: u32 = 11;
const DESC_IP: u32 = 12;
const DESC_IP6: u32 = 13;
// nft's `enum byteorder`.
const BYTEORDER_INVALID: u32 = 0;
const BYTEORDER_HOST: u32 = 1;
const BYTEORDER_BIG: u32 = 2;

impl TypeofExpr {
    /// How nft writes the expression in a declaration.
    pub(crate) fn text(self) -> String {
        match self {
            TypeofExpr::IpSaddr => "ip saddr".into(),
            TypeofExpr::IpDaddr => "ip daddr".into(),
            TypeofExpr::Ip6Saddr => "ip6 saddr".into(),
            TypeofExpr::Ip6Daddr => "ip6 daddr".into(),
            TypeofExpr::ThDport => "th dport".into(),
            TypeofExpr::MetaL4proto => "meta l4proto".into(),
            TypeofExpr::NumgenRandom { modulus, offset: 0 } => {
                format!("numgen random mod {modulus}")
            }
            TypeofExpr::NumgenRandom { modulus, offset } => {
                format!("numgen random mod {modulus} offset {offset}")
            }
        }
    }

    /// The key or value type the expression yields.
    pub fn data_type(self) -> DataType {
        match self {
            TypeofExpr::IpSaddr | TypeofExpr::IpDaddr => DataType::Ipv4Addr,
            TypeofExpr::Ip6Saddr | TypeofExpr::Ip6Daddr => DataType::Ipv6Addr,
            TypeofExpr::ThDport => DataType::InetService,
            TypeofExpr::MetaL4proto => DataType::InetProto,
            TypeofExpr::NumgenRandom { .. } => DataType::Integer(4),
        }
    }

    fn byteorder(self) -> u32 {
        match self {
            TypeofExpr::MetaL4proto | TypeofExpr::NumgenRandom { .. } => BYTEORDER_HOST,
            _ => BYTEORDER_BIG,
        }
    }

    fn expr_type(self) -> u32 {
        match self {
            TypeofExpr::MetaL4proto => EXPR_META,
            TypeofExpr::NumgenRandom { .. } => EXPR_NUMGEN,
            _ => EXPR_PAYLOAD,
        }
    }

    /// The expression's own description (nft's `build_udata` of its kind).
    fn own_data(self) -> Vec<u8> {
        let payload = |desc, field| [u32_tlv(0, desc), u32_tlv(1, field)].concat();
        match self {
            TypeofExpr::IpSaddr => payload(DESC_IP, 11),
            TypeofExpr::IpDaddr => payload(DESC_IP, 12),
            TypeofExpr::Ip6Saddr => payload(DESC_IP6, 8),
            TypeofExpr::Ip6Daddr => payload(DESC_IP6, 9),
            TypeofExpr::ThDport => payload(DESC_TH, 2),
            TypeofExpr::MetaL4proto => u32_tlv(0, MetaKey::L4Proto.number()),
            TypeofExpr::NumgenRandom { modulus, offset } => {
                [u32_tlv(0, 1), u32_tlv(1, modulus), u32_tlv(2, offset)].concat()
            }
        }
    }

    fn from_own_data(expr_type: u32, data: &[u8]) -> Option<TypeofExpr> {
        let fields = parse_u32s(data)?;
        let get = |t: u8| fields.iter().find(|(k, _)| *k == t).map(|(_, v)| *v);
        Some(match expr_type {
            EXPR_META if get(0)? == MetaKey::L4Proto.number() => TypeofExpr::MetaL4proto,
            EXPR_NUMGEN if get(0)? == 1 => TypeofExpr::NumgenRandom {
                modulus: get(1)?,
                offset: get(2).unwrap_or(0),
            },
            EXPR_PAYLOAD => match (get(0)?, get(1)?) {
                (DESC_IP, 11) => TypeofExpr::IpSaddr,
                (DESC_IP, 12) => TypeofExpr::IpDaddr,
                (DESC_IP6, 8) => TypeofExpr::Ip6Saddr,
                (DESC_IP6, 9) => TypeofExpr::Ip6Daddr,
                (DESC_TH, 2) => TypeofExpr::ThDport,
                _ => return None,
            },
            _ => return None,
        })
    }
}

/// What the declaration of a set says: its key (and value) types, or the expressions it was declared with.
#[derive(Debug, Clone, Copy)]
pub struct Declared<'a> {
    /// The key's types.
    pub key: &'a [DataType],
    /// The value's types (maps).
    pub data: &'a [DataType],
    /// The key's declaring expressions, if declared by `typeof`.
    pub key_typeof: Option<&'a [TypeofExpr]>,
    /// The value's declaring expressions, if declared by `typeof`.
    pub data_typeof: Option<&'a [TypeofExpr]>,
    /// An anonymous set (a rule's literal set).
    pub anonymous: bool,
}

impl<'a> Declared<'a> {
    /// What a set's declaration says.
    pub fn of(set: &'a Set) -> Self {
        Declared {
            key: &set.key,
            data: &set.data,
            key_typeof: set.key_typeof.as_deref(),
            data_typeof: set.data_typeof.as_deref(),
            anonymous: false,
        }
    }
}

/// The user data nft writes for a set so declared.
pub fn set_userdata(d: Declared<'_>) -> Vec<u8> {
    let mut out = u32_tlv(KEY_BYTEORDER, byteorder(d.key, d.key_typeof));
    let is_map = !d.data.is_empty();
    if is_map {
        out.extend(u32_tlv(DATA_BYTEORDER, byteorder(d.data, d.data_typeof)));
    }
    match (d.key_typeof, d.key.len() > 1) {
        (Some(exprs), _) => out.extend(tlv(KEY_TYPEOF, &typeof_data(exprs))),
        // A concatenation declared by type names: nft still records that it is one.
        (None, true) => out.extend(tlv(KEY_TYPEOF, &typeof_data(&[]))),
        (None, false) => {}
    }
    if let Some(exprs) = d.data_typeof {
        out.extend(tlv(DATA_TYPEOF, &typeof_data(exprs)));
    }
    if is_map && !d.anonymous {
        out.extend(u32_tlv(DATA_INTERVAL, 0));
    }
    out
}

/// The typeof declarations in a set's user data: (key, value). None where the set was declared by type
/// names, or where the data is not something nftkube writes.
pub fn parse_typeof(udata: &[u8]) -> (Option<Vec<TypeofExpr>>, Option<Vec<TypeofExpr>>) {
    let Some(items) = parse_tlvs(udata) else {
        return (None, None);
    };
    let find = |t: u8| {
        items
            .iter()
            .find(|(k, _)| *k == t)
            .and_then(|(_, v)| parse_typeof_data(v))
            .filter(|e| !e.is_empty())
    };
    (find(KEY_TYPEOF), find(DATA_TYPEOF))
}

fn byteorder(types: &[DataType], exprs: Option<&[TypeofExpr]>) -> u32 {
    if let Some([e]) = exprs {
        return e.byteorder();
    }
    match types {
        [DataType::Ipv4Addr | DataType::Ipv6Addr | DataType::InetService] => BYTEORDER_BIG,
        [DataType::Mark | DataType::Integer(_)] => BYTEORDER_HOST,
        _ => BYTEORDER_INVALID,
    }
}

/// One expression as itself, several as a concatenation of numbered components.
fn typeof_data(exprs: &[TypeofExpr]) -> Vec<u8> {
    if let [e] = exprs {
        return [
            u32_tlv(TYPEOF_EXPR, e.expr_type()),
            tlv(TYPEOF_DATA, &e.own_data()),
        ]
        .concat();
    }
    let components: Vec<u8> = exprs
        .iter()
        .enumerate()
        .flat_map(|(i, e)| {
            let inner = [u32_tlv(0, e.expr_type()), tlv(1, &e.own_data())].concat();
            tlv(i as u8, &inner)
        })
        .collect();
    [
        u32_tlv(TYPEOF_EXPR, EXPR_CONCAT),
        tlv(TYPEOF_DATA, &components),
    ]
    .concat()
}

fn parse_typeof_data(data: &[u8]) -> Option<Vec<TypeofExpr>> {
    let items = parse_tlvs(data)?;
    let expr_type = le32(&items.iter().find(|(k, _)| *k == TYPEOF_EXPR)?.1)?;
    let own = &items.iter().find(|(k, _)| *k == TYPEOF_DATA)?.1;
    if expr_type != EXPR_CONCAT {
        return Some(vec![TypeofExpr::from_own_data(expr_type, own)?]);
    }
    parse_tlvs(own)?
        .iter()
        .map(|(_, component)| {
            let parts = parse_tlvs(component)?;
            let t = le32(&parts.iter().find(|(k, _)| *k == 0)?.1)?;
            let d = &parts.iter().find(|(k, _)| *k == 1)?.1;
            TypeofExpr::from_own_data(t, d)
        })
        .collect()
}

fn tlv(t: u8, value: &[u8]) -> Vec<u8> {
    let len = u8::try_from(value.len()).expect("a user data value fits 255 bytes");
    let mut out = vec![t, len];
    out.extend_from_slice(value);
    out
}

fn u32_tlv(t: u8, v: u32) -> Vec<u8> {
    tlv(t, &v.to_ne_bytes())
}

fn le32(b: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(b.try_into().ok()?))
}

fn parse_tlvs(mut b: &[u8]) -> Option<Vec<(u8, Vec<u8>)>> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let (t, len) = (*b.first()?, *b.get(1)? as usize);
        out.push((t, b.get(2..2 + len)?.to_vec()));
        b = &b[2 + len..];
    }
    Some(out)
}

fn parse_u32s(b: &[u8]) -> Option<Vec<(u8, u32)>> {
    parse_tlvs(b)?
        .into_iter()
        .map(|(t, v)| Some((t, le32(&v)?)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    fn declared<'a>(key: &'a [DataType], data: &'a [DataType]) -> Declared<'a> {
        Declared {
            key,
            data,
            key_typeof: None,
            data_typeof: None,
            anonymous: false,
        }
    }

    // Expected bytes: what nft 1.0.6 sent for the same declarations (`nft --debug=mnl -f`).
    #[test]
    fn type_declarations_match_nft() {
        use DataType::*;
        assert_eq!(
            hex(&set_userdata(declared(&[Ipv4Addr], &[]))),
            "000402000000"
        );
        assert_eq!(
            hex(&set_userdata(declared(&[InetProto], &[]))),
            "000400000000"
        );
        assert_eq!(
            hex(&set_userdata(declared(&[Ipv4Addr, Ipv4Addr], &[]))),
            "000400000000030800040d0000000100"
        );
        assert_eq!(
            hex(&set_userdata(declared(&[Ipv4Addr], &[Ipv4Addr]))),
            "000402000000010402000000060400000000"
        );
        assert_eq!(
            hex(&set_userdata(declared(
                &[Ipv4Addr, InetProto, InetService],
                &[Verdict]
            ))),
            "000400000000010400000000030800040d0000000100060400000000"
        );
    }

    #[test]
    fn typeof_declarations_match_nft_and_parse_back() {
        use TypeofExpr::*;
        let key = [
            Ip6Daddr,
            MetaL4proto,
            ThDport,
            NumgenRandom {
                modulus: 1,
                offset: 0,
            },
        ];
        let data = [Ip6Daddr, ThDport];
        let types: Vec<DataType> = key.iter().map(|e| e.data_type()).collect();
        let dtypes: Vec<DataType> = data.iter().map(|e| e.data_type()).collect();
        let d = Declared {
            key: &types,
            data: &dtypes,
            key_typeof: Some(&key),
            data_typeof: Some(&data),
            anonymous: false,
        };
        let bytes = set_userdata(d);
        assert_eq!(
            hex(&bytes),
            "000400000000010400000000036000040d00000001580014000407000000010c00040d000000010409000000010e00040900000001060004100000000214000407000000010c00040b000000010402000000031a0004170000000112000401000000010401000000020400000000043400040d000000012c0014000407000000010c00040d0000000104090000000114000407000000010c00040b000000010402000000060400000000"
        );
        assert_eq!(
            parse_typeof(&bytes),
            (Some(key.to_vec()), Some(data.to_vec()))
        );
        let anon = Declared {
            key: &[DataType::InetProto],
            data: &[],
            key_typeof: Some(&[MetaL4proto]),
            data_typeof: None,
            anonymous: true,
        };
        assert_eq!(
            hex(&set_userdata(anon)),
            "000401000000030e0004090000000106000410000000"
        );
    }

    #[test]
    fn type_declarations_parse_as_no_typeof() {
        let bytes = set_userdata(declared(&[DataType::Ipv4Addr, DataType::Ipv4Addr], &[]));
        assert_eq!(parse_typeof(&bytes), (None, None));
        assert_eq!(parse_typeof(&[0xff]), (None, None));
    }
}
