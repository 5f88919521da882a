//! [`Text`]: a dataset value as the text a holoware inserts.

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

/// A value from a data row, as text. Strings are taken verbatim; numbers, booleans, arrays and objects
/// are written as JSON writes them (`3`, `2.5`, `true`, `[1,2]`), so any column can be inserted without
/// conversion. (`null` is an absent value: use `Option<Text>`.)
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Text(pub String);

impl Text {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for Text {
    fn from(text: &str) -> Self {
        Text(text.to_string())
    }
}

impl From<String> for Text {
    fn from(text: String) -> Self {
        Text(text)
    }
}

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TextVisitor;

        impl<'de> Visitor<'de> for TextVisitor {
            type Value = Text;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, a number, a boolean, an array or an object")
            }

            fn visit_str<E: de::Error>(self, value: &str) -> Result<Text, E> {
                Ok(Text(value.to_string()))
            }

            fn visit_string<E: de::Error>(self, value: String) -> Result<Text, E> {
                Ok(Text(value))
            }

            fn visit_bool<E: de::Error>(self, value: bool) -> Result<Text, E> {
                Ok(Text(value.to_string()))
            }

            fn visit_i64<E: de::Error>(self, value: i64) -> Result<Text, E> {
                Ok(Text(value.to_string()))
            }

            fn visit_u64<E: de::Error>(self, value: u64) -> Result<Text, E> {
                Ok(Text(value.to_string()))
            }

            fn visit_seq<A: de::SeqAccess<'de>>(self, seq: A) -> Result<Text, A::Error> {
                let value =
                    serde_json::Value::deserialize(de::value::SeqAccessDeserializer::new(seq))?;
                Ok(Text(value.to_string()))
            }

            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Text, A::Error> {
                let value =
                    serde_json::Value::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(Text(value.to_string()))
            }

            fn visit_f64<E: de::Error>(self, value: f64) -> Result<Text, E> {
                // As JSON writes it (`1.0`, `1e21`), like the interpreter's rows.
                Ok(Text(serde_json::Value::from(value).to_string()))
            }
        }

        deserializer.deserialize_any(TextVisitor)
    }
}
