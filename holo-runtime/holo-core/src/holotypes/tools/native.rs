//! Native tool calls: a turn read in the offered format ([`ToolFormat::read`]), every call checked
//! against its tool's schema and run, and each result appended as a `tool` message
//! ([`Cx::tool_result`]), which the Holophore renders with the model's chat template and never trains.
//! What the model got wrong (a call that is not well-formed, an unknown tool, arguments that do not fit
//! the schema) is a `tool` message too, and a failed call in [`ToolStats`] (`tools/failed`).

use super::{schema, Tools};
use crate::holotype::{Cx, Enter};
use crate::holotypes::stats::ToolStats;
use crate::tools::ToolFormat;

/// Runs the calls of `turn`; [`Enter::Skip`] when it makes none (the model answered).
pub(super) fn execute(
    tools: &Tools,
    stats: Option<&ToolStats>,
    format: ToolFormat,
    turn: &str,
    cx: &mut Cx<'_>,
) -> Enter {
    let record = |succeeded: bool, timed_out: bool| {
        if let Some(stats) = stats {
            stats.record(succeeded, timed_out);
        }
    };
    let reply = match format.read(turn) {
        Ok(None) => return Enter::Skip,
        Ok(Some(reply)) => reply,
        Err(message) => {
            record(false, false);
            // No call was read, so the result answers no function: templates that show a result's
            // name get the format's.
            cx.tool_result(format.name(), &format!("error: {message}"));
            return Enter::Run;
        }
    };
    cx.tool_calls(&reply);
    for call in &reply.calls {
        let outcome = tools.find(&call.name).and_then(|tool| {
            schema::check(
                &schema::json_schema(&tool.parameters),
                &call.arguments,
                "arguments",
            )
            .map(|()| tool)
        });
        let result = match outcome {
            Err(message) => {
                record(false, false);
                format!("error: {message}")
            }
            Ok(tool) => match tools.run(tool, call.arguments.clone()) {
                Ok(result) => {
                    record(true, false);
                    result
                }
                Err(failure) => {
                    record(false, failure.timed_out);
                    format!("error: {}", failure.message)
                }
            },
        };
        cx.tool_result(&call.name, &result);
    }
    Enter::Run
}
