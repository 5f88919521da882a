// The Holoware extension: the grammar and language configuration colour .hol files; this client starts
// `holoc lsp` for errors as you type, hover, go to definition, completion, symbols and formatting.
const vscode = require("vscode");
const { LanguageClient } = require("vscode-languageclient/node");

let client;

function activate(context) {
  const command = vscode.workspace.getConfiguration("holoware").get("server.path", "holoc");
  const server = { command, args: ["lsp"] };
  client = new LanguageClient(
    "holoware",
    "Holoware (holoc lsp)",
    { run: server, debug: server },
    { documentSelector: [{ scheme: "file", language: "holoware" }, { scheme: "untitled", language: "holoware" }] }
  );
  client.start().catch((error) => {
    vscode.window.showErrorMessage(
      `Holoware: could not start \`${command} lsp\` (${error.message}). Install holoc ` +
        "(cargo install --path holoc) or set holoware.server.path."
    );
  });
  context.subscriptions.push({ dispose: () => client && client.stop() });
}

function deactivate() {
  return client ? client.stop() : undefined;
}

module.exports = { activate, deactivate };
