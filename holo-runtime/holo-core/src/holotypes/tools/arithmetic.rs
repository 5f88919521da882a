//! The calculator's arithmetic: `+ - * /`, unary minus, parentheses and decimal numbers.

/// A recursive-descent evaluator for `+ - * /`, unary minus, parentheses and decimal numbers.
pub(super) struct Arithmetic<'e> {
    text: &'e [u8],
    at: usize,
}

impl<'e> Arithmetic<'e> {
    pub(super) fn new(expression: &'e str) -> Self {
        Arithmetic {
            text: expression.as_bytes(),
            at: 0,
        }
    }

    pub(super) fn evaluate(mut self) -> Result<f64, String> {
        let value = self.sum()?;
        self.skip_spaces();
        if self.at < self.text.len() {
            return Err(format!(
                "unexpected `{}` at position {}",
                self.text[self.at] as char,
                self.at + 1
            ));
        }
        if !value.is_finite() {
            return Err("the result is not a finite number (division by zero?)".to_string());
        }
        Ok(value)
    }

    fn skip_spaces(&mut self) {
        while self.text.get(self.at).is_some_and(u8::is_ascii_whitespace) {
            self.at += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_spaces();
        self.text.get(self.at).copied()
    }

    fn sum(&mut self) -> Result<f64, String> {
        let mut value = self.product()?;
        while let Some(op @ (b'+' | b'-')) = self.peek() {
            self.at += 1;
            let right = self.product()?;
            value = if op == b'+' {
                value + right
            } else {
                value - right
            };
        }
        Ok(value)
    }

    fn product(&mut self) -> Result<f64, String> {
        let mut value = self.factor()?;
        while let Some(op @ (b'*' | b'/')) = self.peek() {
            self.at += 1;
            let right = self.factor()?;
            value = if op == b'*' {
                value * right
            } else {
                value / right
            };
        }
        Ok(value)
    }

    fn factor(&mut self) -> Result<f64, String> {
        match self.peek() {
            Some(b'-') => {
                self.at += 1;
                Ok(-self.factor()?)
            }
            Some(b'(') => {
                self.at += 1;
                let value = self.sum()?;
                if self.peek() != Some(b')') {
                    return Err("missing `)`".to_string());
                }
                self.at += 1;
                Ok(value)
            }
            Some(c) if c.is_ascii_digit() || c == b'.' => {
                let start = self.at;
                while self
                    .text
                    .get(self.at)
                    .is_some_and(|c| c.is_ascii_digit() || *c == b'.')
                {
                    self.at += 1;
                }
                let number = std::str::from_utf8(&self.text[start..self.at]).unwrap_or_default();
                number
                    .parse()
                    .map_err(|_| format!("`{number}` is not a number"))
            }
            Some(c) => Err(format!(
                "unexpected `{}` at position {}",
                c as char,
                self.at + 1
            )),
            None => Err("the expression ends too early".to_string()),
        }
    }
}
