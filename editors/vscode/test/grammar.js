// Grammar tests: the assertions of test/cases/*.hol (vscode-tmgrammar-test), and snapshots of the scopes
// of every file of the errloom corpus and the standard library (vscode-tmgrammar-snap), kept in
// test/corpus/*.snap. The corpus files are copied next to their snapshots first, because the snapshot
// tool reads each snapshot beside its file. `node test/grammar.js --update` rewrites the snapshots.
const { execFileSync } = require("child_process");
const fs = require("fs");
const path = require("path");

const here = __dirname;
const extension = path.join(here, "..");
const repo = path.join(extension, "..", "..");
const corpus = path.join(here, "corpus");
const bin = (name) => path.join(extension, "node_modules", ".bin", name);

function holFiles(dir, prefix) {
  return fs.readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const full = path.join(dir, entry.name);
    if (entry.isDirectory()) return holFiles(full, `${prefix}${entry.name}__`);
    return entry.name.endsWith(".hol") ? [[full, `${prefix}${entry.name}`]] : [];
  });
}

fs.mkdirSync(corpus, { recursive: true });
const sources = [
  ...holFiles(path.join(repo, "tests", "corpus", "errloom"), "errloom__"),
  ...holFiles(path.join(repo, "hol"), "hol__"),
];
for (const [source, name] of sources) fs.copyFileSync(source, path.join(corpus, name));

const grammar = ["-g", path.join(extension, "syntaxes", "holoware.tmLanguage.json")];
const options = { cwd: extension, stdio: "inherit" };
execFileSync(bin("vscode-tmgrammar-test"), [...grammar, "test/cases/*.hol"], options);
const update = process.argv.includes("--update") ? ["--updateSnapshot"] : [];
execFileSync(bin("vscode-tmgrammar-snap"), [...grammar, ...update, "test/corpus/*.hol"], options);
