from quickdraft.cli.main import main

raise SystemExit(main())
