//! `muser up`'s settings from three places besides its built-in defaults, in this order of
//! precedence: the command line, `MUSER_*` environment variables, a TOML file (`--config FILE`
//! or `MUSER_CONFIG`). The file's keys, the variables' names and the values' types all come
//! from the flags' clap definitions, so a flag added to `muser up` is configurable everywhere
//! with no other edit (docs/configuration.md).
//!
//! The file's settings reach clap as command-line arguments placed before the user's, and only
//! for the flags neither the command line nor the environment sets: each value then passes the
//! flag's own parser, and `requires`/`conflicts_with` apply to it as to a typed flag.

use clap::builder::BoolishValueParser;
use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Command};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt::Write as _;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use toml::{Spanned, Value};

/// The flags about the configuration itself (a file cannot set them).
#[derive(clap::Args)]
pub struct ConfigArgs {
    /// Settings from a TOML file whose keys are the long flag names (`ctx-size = 4096`,
    /// `host = ["127.0.0.1", "::1"]`, `metrics = true`). Precedence: command line, then
    /// MUSER_<FLAG> environment variables, then this file, then the defaults.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print the effective settings as TOML, each with where it came from (secrets
    /// redacted), and exit.
    #[arg(long)]
    pub print_config: bool,
}

/// The subcommand whose flags are layered.
const SUBCOMMAND: &str = "up";
/// Keys a file may not hold: the flags of [`ConfigArgs`].
const META_KEYS: [&str; 2] = ["config", "print-config"];
/// Keys whose values are secrets: redacted when printed, refused in a file others can read.
const SECRET_KEYS: [&str; 1] = ["api-key"];
/// The largest config file read.
const FILE_BYTES_MAX: u64 = 1 << 20;

/// Where a setting came from, highest precedence first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    CommandLine,
    Env(String),
    File { path: PathBuf, line: usize },
    Default,
}

impl Source {
    /// 0 for the command line, up to 3 for a default: the lower wins.
    pub fn rank(&self) -> u8 {
        match self {
            Source::CommandLine => 0,
            Source::Env(_) => 1,
            Source::File { .. } => 2,
            Source::Default => 3,
        }
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::CommandLine => f.write_str("command line"),
            Source::Env(name) => write!(f, "environment {name}"),
            Source::File { path, line } => write!(f, "{}:{line}", path.display()),
            Source::Default => f.write_str("default"),
        }
    }
}

/// The config-file key of a flag: its long name, `_` spelled `-` (`None` for --help/--version,
/// which are not settings).
fn key(arg: &Arg) -> Option<String> {
    match arg.get_action() {
        ArgAction::Help | ArgAction::HelpShort | ArgAction::HelpLong | ArgAction::Version => None,
        _ => arg.get_long().map(|l| l.replace('_', "-")),
    }
}

/// The environment variable of a key: `MUSER_` and the key in screaming snake case.
fn env_name(key: &str) -> String {
    format!("MUSER_{}", key.replace('-', "_").to_ascii_uppercase())
}

/// `up` with every flag reading its `MUSER_*` variable (an empty one counts as unset), and its
/// switches taking `true/false/1/0/yes/no/on/off` there.
fn with_env(up: Command) -> Command {
    up.mut_args(|arg| {
        let Some(key) = key(&arg) else { return arg };
        let arg = match arg.get_action() {
            ArgAction::SetTrue => arg.value_parser(BoolishValueParser::new()),
            _ => arg,
        };
        let name = env_name(&key);
        if std::env::var_os(&name).is_some_and(|v| v.is_empty()) {
            return arg;
        }
        arg.env(name).hide_env_values(true)
    })
}

/// Names each of llama-server's `LLAMA_ARG_*` variables set: `muser up` does not read them
/// (docs/configuration.md says why).
pub fn note_llama_env() {
    for (name, _) in std::env::vars_os() {
        if let Some(name) = name.to_str().filter(|n| n.starts_with("LLAMA_ARG_")) {
            eprintln!("muser: {name} is llama-server's variable and is not read; muser up reads MUSER_<FLAG> (docs/configuration.md)");
        }
    }
}

/// What `muser up` was given, and where each setting came from.
pub struct Settings {
    up: Command,
    matches: ArgMatches,
    sources: BTreeMap<String, Source>,
}

/// Parses the command line `argv` of `cli`; for `muser up`, with the environment and the config
/// file layered under it. Errors exit as clap's do (status 2, nothing started).
pub fn parse(cli: Command, argv: Vec<OsString>) -> (ArgMatches, Option<Settings>) {
    try_parse(cli, argv).unwrap_or_else(|f| f.exit())
}

/// A failed parse: clap's error, and the config-file setting it is about, if it is about one.
pub struct Failure {
    error: clap::Error,
    blame: Option<String>,
}

impl Failure {
    pub fn exit(self) -> ! {
        if let Some(b) = self.blame {
            eprintln!("muser: {b}");
        }
        self.error.exit()
    }
}

impl From<clap::Error> for Failure {
    fn from(error: clap::Error) -> Self {
        Failure { error, blame: None }
    }
}

/// [`parse`], returning its errors.
fn try_parse(cli: Command, argv: Vec<OsString>) -> Result<(ArgMatches, Option<Settings>), Failure> {
    if argv.get(1).is_none_or(|a| a != SUBCOMMAND) {
        return Ok((cli.try_get_matches_from(argv)?, None));
    }
    let cli = cli.mut_subcommand(SUBCOMMAND, with_env);
    let up = cli.find_subcommand(SUBCOMMAND).expect("up").clone();
    // which flags the command line and the environment set, and the file's name: errors wait
    // for the real parse below, which may need the file's values (a `requires` it satisfies)
    let first = cli
        .clone()
        .mut_subcommand(SUBCOMMAND, |c| c.ignore_errors(true))
        .try_get_matches_from(&argv)
        .ok();
    let first = first
        .as_ref()
        .and_then(|m| m.subcommand_matches(SUBCOMMAND));
    let file = match first.and_then(|m| m.get_one::<PathBuf>("config")) {
        Some(path) => read_file(&up, path, first)?,
        None => FileSettings::default(),
    };
    let mut full = argv[..2].to_vec();
    full.extend(file.args.iter().map(OsString::from));
    full.extend_from_slice(&argv[2..]);
    let matches = cli.try_get_matches_from(full).map_err(|error| Failure {
        blame: blame(&error, &up, &file),
        error,
    })?;
    let up_matches = matches.subcommand_matches(SUBCOMMAND).expect("up").clone();
    let sources = sources(&up, &up_matches, file.lines);
    let settings = Settings {
        up,
        matches: up_matches,
        sources,
    };
    Ok((matches, Some(settings)))
}

/// The arguments a config file stands for, and the file line of each key.
#[derive(Default)]
struct FileSettings {
    args: Vec<String>,
    lines: BTreeMap<String, Source>,
}

/// Reads `path` into arguments of `up`, leaving out the flags `given` (the command line's and
/// the environment's) sets.
fn read_file(
    up: &Command,
    path: &Path,
    given: Option<&ArgMatches>,
) -> Result<FileSettings, clap::Error> {
    let fail = |msg: String| clap::Error::raw(ErrorKind::ValueValidation, msg + "\n");
    let text = read_bounded(path).map_err(|e| fail(format!("config {}: {e}", path.display())))?;
    let table: BTreeMap<Spanned<String>, Spanned<Value>> = toml::from_str(&text)
        .map_err(|e| fail(format!("config {}: not valid TOML: {e}", path.display())))?;
    let line_of = |offset: usize| 1 + text[..offset].matches('\n').count();
    let mut out = FileSettings::default();
    for (k, v) in &table {
        let at = Source::File {
            path: path.to_path_buf(),
            line: line_of(k.span().start),
        };
        let here = |msg: String| fail(format!("config {at}: {msg}"));
        let name = k.get_ref();
        if META_KEYS.contains(&name.as_str()) {
            return Err(here(format!(
                "`{name}` belongs on the command line (or in MUSER_CONFIG), not in a config file"
            )));
        }
        let arg = up
            .get_arguments()
            .find(|a| key(a).as_deref() == Some(name))
            .ok_or_else(|| here(unknown_key(up, name)))?;
        if SECRET_KEYS.contains(&name.as_str()) {
            check_private(path).map_err(&here)?;
        }
        let source = given.and_then(|m| m.value_source(arg.get_id().as_str()));
        if matches!(
            source,
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        ) {
            continue;
        }
        out.args
            .extend(to_args(arg, name, v.get_ref()).map_err(&here)?);
        out.lines.insert(arg.get_id().to_string(), at);
    }
    Ok(out)
}

/// A file no longer than [`FILE_BYTES_MAX`], as UTF-8.
fn read_bounded(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(FILE_BYTES_MAX + 1)
        .read_to_string(&mut text)?;
    if text.len() as u64 > FILE_BYTES_MAX {
        return Err(std::io::Error::other(format!(
            "longer than {FILE_BYTES_MAX} bytes"
        )));
    }
    Ok(text)
}

/// A secret is refused in a file that other users may read, as ssh refuses such a key: the
/// server would otherwise start with a key every local user can read, and say nothing.
fn check_private(path: &Path) -> Result<(), String> {
    let mode = std::fs::metadata(path)
        .map_err(|e| e.to_string())?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        return Err(format!(
            "`api-key` in a file that other users can read (mode {:o}): `chmod 600 {}`, or name a private key file with `api-key-file`",
            mode & 0o777,
            path.display()
        ));
    }
    Ok(())
}

/// The message for a key that is no flag, with the closest flag's key as a hint.
fn unknown_key(up: &Command, name: &str) -> String {
    let closest = up
        .get_arguments()
        .filter_map(key)
        .filter(|k| !META_KEYS.contains(&k.as_str()))
        .map(|k| (strsim::jaro(name, &k), k))
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .filter(|(score, _)| *score > 0.7);
    match closest {
        Some((_, k)) => format!("unknown key `{name}`; did you mean `{k}`?"),
        None => format!("unknown key `{name}` (keys are `muser up`'s long flag names)"),
    }
}

/// The command-line arguments of one file setting, its type checked against the flag's kind:
/// a switch takes a boolean, a repeatable flag a value or an array of them, any other flag one
/// value (string, integer or float; its own parser checks it).
fn to_args(arg: &Arg, key: &str, value: &Value) -> Result<Vec<String>, String> {
    let long = arg.get_long().expect("a key is a long flag");
    match (arg.get_action(), value) {
        (ArgAction::SetTrue, Value::Boolean(on)) => {
            Ok(on.then(|| format!("--{long}")).into_iter().collect())
        }
        (ArgAction::SetTrue, v) => Err(format!(
            "`{key}` is a switch: true or false, not {}",
            v.type_str()
        )),
        (ArgAction::Append, Value::Array(items)) => items
            .iter()
            .map(|v| scalar(key, v).map(|s| format!("--{long}={s}")))
            .collect(),
        (_, Value::Array(_)) => Err(format!("`{key}` takes one value, not an array")),
        (_, v) => Ok(vec![format!("--{long}={}", scalar(key, v)?)]),
    }
}

/// A value's text as the command line would give it.
fn scalar(key: &str, value: &Value) -> Result<String, String> {
    match value {
        Value::String(s) => Ok(s.clone()),
        Value::Integer(i) => Ok(i.to_string()),
        Value::Float(f) => Ok(f.to_string()),
        v => Err(format!(
            "`{key}` takes a string or a number, not {}",
            v.type_str()
        )),
    }
}

/// What a clap error owes to the config file, as a line to print before it: the file setting
/// it names, or, for a flag that another requires, the file whose settings may require it.
fn blame(e: &clap::Error, up: &Command, file: &FileSettings) -> Option<String> {
    match e.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(shown)) => up.get_arguments().find_map(|arg| {
            let long = format!("--{}", arg.get_long()?);
            let named = shown.strip_prefix(&long)?;
            if !(named.is_empty() || named.starts_with([' ', '='])) {
                return None;
            }
            let at = file.lines.get(arg.get_id().as_str())?;
            Some(format!("in the config file, `{}` ({at}):", key(arg)?))
        }),
        _ if e.kind() == ErrorKind::MissingRequiredArgument => {
            let Source::File { path, .. } = file.lines.values().next()? else {
                return None;
            };
            Some(format!(
                "with the settings of the config file {}:",
                path.display()
            ))
        }
        _ => None,
    }
}

/// Where each of `up`'s settings came from.
fn sources(
    up: &Command,
    matches: &ArgMatches,
    mut from_file: BTreeMap<String, Source>,
) -> BTreeMap<String, Source> {
    up.get_arguments()
        .filter_map(|arg| {
            let id = arg.get_id().as_str();
            let source = match from_file.remove(id) {
                Some(at) => at,
                None => match matches.value_source(id)? {
                    ValueSource::CommandLine => Source::CommandLine,
                    ValueSource::EnvVariable => Source::Env(env_name(&key(arg)?)),
                    _ => Source::Default,
                },
            };
            Some((id.to_string(), source))
        })
        .collect()
}

impl Settings {
    /// Where the setting of the flag with clap id `id` came from (`None`: not set, no default).
    pub fn source(&self, id: &str) -> Option<&Source> {
        self.sources.get(id)
    }

    /// The effective settings as a TOML file, each line saying where its value came from:
    /// defaults commented out (a file of the other lines reads back as the same settings),
    /// secrets redacted, hidden flags (llama-server spellings) only when set.
    pub fn to_toml(&self) -> String {
        let mut out = String::from(
            "# muser up: effective settings (command line > environment > config file > defaults)\n",
        );
        for arg in self.up.get_arguments() {
            let (Some(key), Some(source)) = (key(arg), self.source(arg.get_id().as_str())) else {
                continue;
            };
            if META_KEYS.contains(&key.as_str())
                || (arg.is_hide_set() && *source == Source::Default)
            {
                continue;
            }
            let comment = if *source == Source::Default { "# " } else { "" };
            let _ = match self.value(arg, &key) {
                Some(value) => writeln!(out, "{comment}{key} = {value}  # {source}"),
                None => writeln!(out, "# {key} given without a value  # {source}"),
            };
        }
        out
    }

    /// One setting's value as TOML (`None`: a flag with an optional value given bare, as
    /// `--slots`).
    fn value(&self, arg: &Arg, key: &str) -> Option<String> {
        let id = arg.get_id().as_str();
        if SECRET_KEYS.contains(&key) {
            return Some("\"(redacted)\"".into());
        }
        if matches!(arg.get_action(), ArgAction::SetTrue) {
            return Some(self.matches.get_flag(id).to_string());
        }
        let raw: Vec<String> = self
            .matches
            .get_raw(id)
            .into_iter()
            .flatten()
            .map(|v| toml_scalar(&v.to_string_lossy()))
            .collect();
        match (arg.get_action(), raw.as_slice()) {
            (ArgAction::Append, _) => Some(format!("[{}]", raw.join(", "))),
            (_, [one]) => Some(one.clone()),
            _ => None,
        }
    }
}

/// A command-line value as a TOML scalar: a number bare when TOML writes it the same way,
/// anything else a quoted string (either reads back as the same argument).
fn toml_scalar(raw: &str) -> String {
    let number = match (raw.parse::<i64>(), raw.parse::<f64>()) {
        (Ok(i), _) => Some(Value::Integer(i)),
        (_, Ok(f)) if f.is_finite() => Some(Value::Float(f)),
        _ => None,
    };
    match number.map(|n| n.to_string()) {
        Some(n) if n == raw => n,
        _ => Value::String(raw.to_string()).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, FromArgMatches};

    fn parse_up(args: &[&str]) -> Result<(ArgMatches, Settings), Failure> {
        let argv = ["muser", "up"]
            .iter()
            .chain(args)
            .map(OsString::from)
            .collect();
        let (m, settings) = try_parse(crate::Cli::command(), argv)?;
        Ok((m, settings.expect("up")))
    }

    /// Values for `arg` as TOML, one of which its parser takes: a switch's `true`, its first
    /// possible value, else a number, an address or a speculative mode (a new flag whose
    /// parser takes none of these fails the test below until its kind of value is added).
    fn samples(arg: &Arg) -> Vec<String> {
        if matches!(arg.get_action(), ArgAction::SetTrue) {
            return vec!["true".into()];
        }
        let named = arg.get_possible_values().into_iter().next();
        match named {
            Some(v) => vec![format!("{:?}", v.get_name())],
            None => ["1", "\"127.0.0.1\"", "\"ngram\""]
                .map(String::from)
                .to_vec(),
        }
    }

    /// The long names of the flags a "missing required argument" error names.
    fn missing(e: &clap::Error) -> Vec<String> {
        let Some(ContextValue::Strings(shown)) = e.get(ContextKind::InvalidArg) else {
            return Vec::new();
        };
        shown
            .iter()
            .filter_map(|s| {
                let rest = &s[s.find("--")? + 2..];
                let end = rest
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
                    .unwrap_or(rest.len());
                Some(rest[..end].to_string())
            })
            .collect()
    }

    /// `key = value` for `arg`, an array for a repeatable flag.
    fn toml_line(arg: &Arg, value: &str) -> String {
        let k = key(arg).unwrap();
        match arg.get_action() {
            ArgAction::Append => format!("{k} = [{value}]\n"),
            _ => format!("{k} = {value}\n"),
        }
    }

    /// `up` parsed with a file of `extra` and a line setting `arg` to the first of its samples
    /// that parses: the sample, the matches, the settings and the file; else the error of a
    /// missing required flag, if any sample met one, or the last.
    fn from_file(
        dir: &Path,
        arg: &Arg,
        extra: &str,
    ) -> Result<(String, ArgMatches, Settings, PathBuf), Failure> {
        let file = dir.join(format!("{}.toml", key(arg).unwrap()));
        let mut failed: Option<Failure> = None;
        for v in samples(arg) {
            std::fs::write(&file, format!("{extra}{}", toml_line(arg, &v))).unwrap();
            std::fs::set_permissions(&file, PermissionsExt::from_mode(0o600)).unwrap();
            match parse_up(&["--config", file.to_str().unwrap()]) {
                Ok((m, settings)) => return Ok((v, m, settings, file)),
                Err(f) => {
                    let missing = |f: &Option<Failure>| {
                        f.as_ref()
                            .is_some_and(|f| f.error.kind() == ErrorKind::MissingRequiredArgument)
                    };
                    if !missing(&failed) {
                        failed = Some(f);
                    }
                }
            }
        }
        Err(failed.expect("at least one sample"))
    }

    #[test]
    fn every_flag_of_up_is_settable_from_a_file_and_from_its_variable() {
        let dir = tempfile::tempdir().unwrap();
        let up = crate::Cli::command()
            .find_subcommand(SUBCOMMAND)
            .unwrap()
            .clone();
        let mut checked = 0;
        for arg in up.get_arguments() {
            let Some(k) = key(arg) else { continue };
            if META_KEYS.contains(&k.as_str()) {
                continue;
            }
            let id = arg.get_id().as_str();
            // the flags it requires come first in the file, so that its line is the last
            let mut extra = String::new();
            let mut tries = 0;
            let (v, matches, settings, file) = loop {
                match from_file(dir.path(), arg, &extra) {
                    Ok(found) => break found,
                    Err(f) if f.error.kind() == ErrorKind::MissingRequiredArgument && tries < 3 => {
                        for long in missing(&f.error) {
                            let other = up
                                .get_arguments()
                                .find(|a| a.get_long() == Some(&long))
                                .unwrap();
                            // (which may require this one: tls-cert and tls-key)
                            let this = toml_line(arg, &samples(arg)[0]);
                            let (v, ..) = from_file(dir.path(), other, &this)
                                .unwrap_or_else(|f| panic!("{}", f.error));
                            extra += &toml_line(other, &v);
                        }
                    }
                    Err(f) => panic!(
                        "`{k}` takes none of {:?} from a file: {}",
                        samples(arg),
                        f.error
                    ),
                }
                tries += 1;
            };
            let line = 1 + extra.lines().count();
            assert_eq!(
                settings.source(id),
                Some(&Source::File { path: file, line }),
                "{k}"
            );
            crate::Cli::from_arg_matches(&matches).unwrap();
            let sub = matches.subcommand_matches(SUBCOMMAND).unwrap();
            match arg.get_action() {
                ArgAction::SetTrue => assert!(sub.get_flag(id), "{k}"),
                _ => {
                    let raw: Vec<_> = sub.get_raw(id).unwrap().collect();
                    assert_eq!(raw, [v.trim_matches('"')], "{k}");
                }
            }
            // the same value from the variable named after the key
            let var = env_name(&k);
            assert_eq!(var, format!("MUSER_{}", k.replace('-', "_").to_uppercase()));
            let value = if v == "true" {
                "1".to_string()
            } else {
                v.trim_matches('"').to_string()
            };
            std::env::set_var(&var, &value);
            let got = parse_up(&[]).map(|(_, s)| s.source(id).cloned());
            std::env::remove_var(&var);
            match got {
                Ok(source) => assert_eq!(source, Some(Source::Env(var)), "{k}"),
                // one that requires another fails alone, as on the command line
                Err(f) => assert_eq!(f.error.kind(), ErrorKind::MissingRequiredArgument, "{k}"),
            }
            checked += 1;
        }
        assert!(checked > 80, "{checked} flags");
    }

    #[test]
    fn printed_values_read_back_as_the_same_arguments() {
        for raw in [
            "4949",
            "0.7",
            "-1",
            "127.0.0.1",
            "1.",
            "1e5",
            "abc \"q\"",
            "0x10",
        ] {
            let text = format!("v = {}", toml_scalar(raw));
            let v: toml::Table = toml::from_str(&text).unwrap();
            assert_eq!(scalar("v", &v["v"]).unwrap(), raw, "{text}");
        }
    }
}
