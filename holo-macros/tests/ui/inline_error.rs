holo_macros::holoware!(qa, r#"
<|o_o|>
<|question|>
<|x_x:answer|>
"#);

fn main() {}
